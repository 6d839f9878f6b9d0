"""The page at ``/`` in a real headless browser (Debian's chromium and chromium-driver through
Selenium), against the real daemon on the built-in demo model and the simulated device.

One daemon and one browser serve the module. Every wait polls for a state with a generous
timeout and returns as soon as it holds: these are not speed checks. The screenshots are written
to ``$STRATA_SCREENSHOTS`` when it is set (``docs/`` for the committed ones:
``STRATA_SCREENSHOTS=docs ./scripts/test tests/integration/test_page.py``), else to the test's
temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import (
    ClientProcess,
    PrivateBus,
    StrataDaemon,
    bus_env,
    daemon_env,
    simulated_device_args,
    strata_ctl,
    strata_ctl_command,
    wait_s,
    write_simulated,
)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOTAL_MIB = 400
GAME_PID, GAME_MIB = 4242, 120  # another program on the simulated GPU
CHROMIUM_ARGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--no-first-run", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--window-size=1280,800",
)  # fmt: skip


def browser_or_skip(profile: Path) -> Any:
    """A headless Chromium through the system chromedriver; skipped, with the reason, where
    chromium, chromedriver or selenium are not installed (.ci/run installs them)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is not installed (Debian: apt install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (the project's test extra has it)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in CHROMIUM_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver's path given: Selenium Manager (which would download one) never runs
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


@pytest.fixture(scope="module")
def strata(
    module_bus: PrivateBus, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StrataDaemon]:
    """The demo model (no --model) on a simulated 400 MiB GPU where a game holds 120 MiB."""
    tmp = tmp_path_factory.mktemp("strata")
    device = tmp / "device.json"
    write_simulated(device, TOTAL_MIB, [(GAME_PID, GAME_MIB)])
    args = simulated_device_args(device, None)  # no --model: the demo
    d = StrataDaemon(tmp, args, env=bus_env(module_bus))
    yield d
    d.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = browser_or_skip(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture
def page(strata: StrataDaemon, browser: Any, logs_on_failure: list[StrataDaemon]) -> Iterator[Any]:
    """The page, freshly loaded at 1280×800 and showing the daemon ready; the browser's
    console printed when a test fails."""
    logs_on_failure.append(strata)
    viewport(browser, 1280, 800)
    browser.get(strata.url + "/")
    wait_until(lambda: text(browser, "state") == "ready", "the page shows the daemon ready")
    yield browser


def viewport(browser: Any, width: int, height: int) -> None:
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """Poll ``predicate`` until it returns something true; that value."""
    timeout = wait_s(timeout)
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)
    return value


def text(browser: Any, element_id: str) -> str:
    return browser.execute_script(f"return document.getElementById({element_id!r}).textContent")


def severe(browser: Any) -> list[dict[str, Any]]:
    return [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def metric(url: str, name: str, **labels: str) -> float:
    body = httpx.get(url + "/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = (
        rf"^{re.escape(name)}(?:\{{{re.escape(want)}\}})? ([0-9.e+-]+)$"
        if want
        else (rf"^{re.escape(name)} ([0-9.e+-]+)$")
    )
    found = re.search(pattern, body, re.M)
    return float(found[1]) if found else 0.0


def chat(browser: Any, message: str, max_tokens: int) -> None:
    browser.execute_script(
        "document.getElementById('max-tokens').value = arguments[0];"
        "document.getElementById('temperature').value = '0';",
        str(max_tokens),
    )
    browser.find_element("id", "prompt").send_keys(message)
    browser.find_element("id", "send").click()


def last_reply(browser: Any) -> dict[str, str]:
    return browser.execute_script(
        "const m = [...document.querySelectorAll('.msg-assistant')].pop();"
        "return m ? {text: m.querySelector('.msg-text').textContent,"
        " note: (m.querySelector('.msg-note') || {}).textContent || ''} : null;"
    ) or {"text": "", "note": ""}


def legend(browser: Any) -> dict[str, str]:
    """The legend's values by layer: e.g. {"kept": "64 MiB", "tenants": "120 MiB", …}."""
    return browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#legend li[data-layer]')]"
        ".map(li => [li.dataset.layer, li.querySelector('.value').textContent]));"
    )


def drawn_layers(browser: Any) -> set[str]:
    return set(
        browser.execute_script(
            "return [...document.querySelectorAll('#chart path[data-layer]')]"
            ".map(p => p.dataset.layer);"
        )
    )


def test_the_page_loads_with_no_console_errors_and_draws_the_memory(
    strata: StrataDaemon, browser: Any
) -> None:
    browser.get_log("browser")  # what earlier pages logged
    viewport(browser, 1280, 800)
    browser.get(strata.url + "/")
    wait_until(lambda: text(browser, "state") == "ready", "the page shows the daemon ready")
    wait_until(lambda: text(browser, "link") == "live", "the status stream is live")
    wait_until(
        lambda: {"core", "tail", "tenants", "free"} <= drawn_layers(browser),
        "the picture draws the cache, the other programs and the free memory",
    )
    assert legend(browser)["tenants"] == f"{GAME_MIB} MiB"
    assert text(browser, "model").startswith("strata-demo")
    assert severe(browser) == []


def test_the_page_and_its_files_need_no_key_and_forbid_other_origins(strata: StrataDaemon) -> None:
    r = httpx.get(strata.url + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "access-control-allow-origin" not in r.headers  # CORS stays closed
    for path in ("/page.js", "/page.css", "/favicon.svg"):
        assert httpx.get(strata.url + path, timeout=30).status_code == 200, path


def test_a_chat_message_streams_an_answer(strata: StrataDaemon, page: Any) -> None:
    before = metric(strata.url, "strata_generations_total", outcome="length")
    chat(page, "Tell me a story.", 24)
    reply = wait_until(lambda: "finish" in last_reply(page)["note"] and last_reply(page),
                       "the answer finishes")  # fmt: skip
    assert reply["text"].strip(), reply
    assert "finish: length" in reply["note"] and "24 tokens" in reply["note"], reply
    assert metric(strata.url, "strata_generations_total", outcome="length") == before + 1
    assert text(page, "chat-error") == ""


def test_bad_sampling_settings_show_the_servers_error_and_keep_the_message(page: Any) -> None:
    page.execute_script("document.getElementById('top-p').value = '7';")
    try:
        page.find_element("id", "prompt").send_keys("Hello?")
        page.find_element("id", "send").click()
        error = wait_until(lambda: text(page, "chat-error"), "the error shown")
        assert "top_p" in error, error  # the server's own message, naming the field
        assert page.find_element("id", "prompt").get_attribute("value") == "Hello?"
    finally:
        page.execute_script(
            "document.getElementById('top-p').value = '0.95';"
            "document.getElementById('prompt').value = '';"
        )


def test_stop_cancels_a_long_generation(strata: StrataDaemon, page: Any) -> None:
    before = metric(strata.url, "strata_generations_total", outcome="cancelled")
    tokens = strata.status()["generated_tokens"]
    chat(page, "Write the longest story you can.", 4000)
    # text arrived while the generation still runs: the answer streams
    wait_until(lambda: last_reply(page)["text"] and page.find_element("id", "stop").is_enabled(),
               "the first text of the answer, with Stop enabled")  # fmt: skip
    page.find_element("id", "stop").click()
    reply = wait_until(lambda: last_reply(page)["note"] == "stopped" and last_reply(page),
                       "the answer marked stopped")  # fmt: skip
    assert reply["text"]
    wait_until(
        lambda: metric(strata.url, "strata_generations_total", outcome="cancelled") == before + 1,
        "the daemon counts the cancelled generation",
    )
    status = strata.wait_for(lambda s: not s["busy"], 60, "the engine idle")
    assert status["generated_tokens"] - tokens < 4000  # it stopped well before its end
    assert page.find_element("id", "send").is_enabled()


def test_a_reserve_set_on_the_page_shows_in_strata_ctl_and_in_the_picture(
    strata: StrataDaemon, page: Any, module_bus: PrivateBus, tmp_path: Path
) -> None:
    field = page.find_element("id", "reserve-input")
    field.clear()
    field.send_keys("64")
    page.find_element("id", "reserve-set").click()
    wait_until(lambda: "a reserve of 64 MiB" in text(page, "reserve-result"),
               "the page says the reserve is set")  # fmt: skip
    r = strata_ctl("status", "--json", env=daemon_env(tmp_path, bus_env(module_bus)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reserve_mib"] == 64
    wait_until(lambda: legend(page).get("kept") == "64 MiB", "the kept room in the picture")
    assert "kept" in drawn_layers(page)
    assert text(page, "reserve-now") == "64 MiB"
    # a bad value: the server's own error text, naming what was wrong
    field.clear()
    field.send_keys("-5")
    page.find_element("id", "reserve-set").click()
    message = wait_until(lambda: "not set" in text(page, "reserve-result")
                         and text(page, "reserve-result"),
                         f"the error shown (shown: {text(page, 'reserve-result')!r})")  # fmt: skip
    assert "reserve_mib: expected a whole number of MiB, 0 or more" in message, message
    assert "got -5" in message and "Input should" not in message, message
    # one that cannot be met (the game's memory leaves too little even at the cache's core):
    # set and pending, as the status and strata-ctl say it, never "not set"
    s = strata.status()
    at_core = s["total_mib"] - GAME_MIB - s["core_mib"] - s["kv_mib"]
    field.clear()
    field.send_keys(str(at_core + GAME_MIB // 2))
    page.find_element("id", "reserve-set").click()
    message = wait_until(
        lambda: "not met yet" in text(page, "reserve-result") and text(page, "reserve-result"),
        "the page says the reserve is pending",
    )
    assert "not set" not in message and "stays in force" in message, message
    wait_until(lambda: text(page, "reserve-now").endswith("(not met yet)"), "the reserve pending")
    assert strata.status()["reserve_state"] == "pending"
    page.find_element("id", "reserve-clear").click()
    wait_until(lambda: strata.status()["reserve_mib"] == 0, "the reserve cleared")
    wait_until(lambda: text(page, "reserve-now") == "0 MiB", "the page shows it cleared")


def test_on_the_cpu_the_page_says_memory_and_offers_no_reserve(
    browser: Any, tmp_path: Path, logs_on_failure: list[StrataDaemon]
) -> None:
    d = StrataDaemon(tmp_path, ["--device", "cpu", "--vram-monitor", "none", "--port", "0"])
    logs_on_failure.append(d)
    try:
        browser.get(d.url + "/")
        wait_until(lambda: text(browser, "state") == "ready", "the page shows the daemon ready")
        wait_until(lambda: "CPU" in text(browser, "memory-title"), "the title says the CPU")
        assert "GPU memory" not in text(browser, "memory-title")
        assert not browser.find_element("id", "reserve-form").is_displayed()
        assert "holds no VRAM" in text(browser, "no-monitor")
    finally:
        d.stop()


def lease_rows(browser: Any) -> list[list[str]]:
    return browser.execute_script(
        "return [...document.querySelectorAll('#lease-rows tr')]"
        ".map(tr => [...tr.children].map(td => td.textContent));"
    )


def test_a_lease_taken_over_dbus_appears_in_the_lease_list(
    strata: StrataDaemon, page: Any, module_bus: PrivateBus, tmp_path: Path
) -> None:
    env = daemon_env(tmp_path, bus_env(module_bus))
    holder = ClientProcess([*strata_ctl_command(), "borrow", "32", "--app-id",
                            "org.example.ImageTool", "--reason", "upscaling", "--", "sleep",
                            "600"], env)  # fmt: skip
    try:
        rows = wait_until(lambda: lease_rows(page), "the lease in the page's list", timeout=60)
        app, reason, mib, since = rows[0]
        assert (app, reason, mib) == ("org.example.ImageTool", "upscaling", "32")
        assert "ago" in since
        assert "lent" in text(page, "borrowed")
    finally:
        holder.kill(signal.SIGTERM)  # strata-ctl ends the command and returns the lease
    wait_until(lambda: lease_rows(page) == [], "the lease gone from the list")


def screenshot_dir(tmp_path: Path) -> Path:
    where = os.environ.get("STRATA_SCREENSHOTS")
    path = Path(where) if where else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_screenshots_at_1280x800_and_narrow(
    strata: StrataDaemon, page: Any, module_bus: PrivateBus, tmp_path: Path
) -> None:
    """A scene worth a picture, on the simulated GPU: a game grows until the cache must shrink
    (a resize on the time axis) and shrinks back (the cache grows again), an image tool borrows
    100 MiB over D-Bus, a reserve is set, a short chat. The test waits for states only; with
    ``$STRATA_SCREENSHOTS`` set, each step is also held a few seconds so that the scene spreads
    over the picture's minute."""
    hold = 9.0 if os.environ.get("STRATA_SCREENSHOTS") else 0.0
    env = daemon_env(tmp_path, bus_env(module_bus))
    device = strata.tmp / "device.json"
    page.execute_script(
        "const w = document.getElementById('window'); w.value = '60';"
        "w.dispatchEvent(new Event('change'));"
    )
    holder = None
    try:
        time.sleep(hold)
        resizes = strata.status()["resizes"]
        write_simulated(device, TOTAL_MIB, [(GAME_PID, TOTAL_MIB - 30)])
        strata.wait_for(lambda s: s["resizes"] > resizes, 60, "the cache shrinks for the game")
        time.sleep(hold)
        write_simulated(device, TOTAL_MIB, [(GAME_PID, 200)])
        strata.wait_for(lambda s: s["cache_mib"] == 48, 60, "the cache grows back")
        time.sleep(hold)
        holder = ClientProcess([*strata_ctl_command(), "borrow", "100", "--app-id",
                                "org.example.ImageTool", "--reason", "upscaling a photo", "--",
                                "sleep", "600"], env)  # fmt: skip
        wait_until(lambda: lease_rows(page), "the lease in the list")
        time.sleep(hold)
        assert strata_ctl("reserve", "30", env=env).returncode == 0
        time.sleep(hold)
        chat(page, "Hello! What can you do?", 64)
        wait_until(lambda: "finish" in last_reply(page)["note"], "the answer finishes")
        wait_until(lambda: text(page, "busy") == "idle", "the page shows the engine idle")
        page.find_element("css selector", "#settings summary").click()
        out = screenshot_dir(tmp_path)
        wide = out / "page-1280x800.png"
        assert page.save_screenshot(str(wide))
        viewport(page, 420, 1320)
        page.execute_script("window.dispatchEvent(new Event('resize'))")  # redrawn to fit
        narrow = out / "page-narrow.png"
        assert page.save_screenshot(str(narrow))
        for shot in (wide, narrow):
            assert shot.stat().st_size > 10_000, shot
        print(f"\nscreenshots: {wide}, {narrow}")
    finally:
        if holder is not None:
            holder.kill(signal.SIGTERM)
        strata_ctl("reserve", "0", env=env)
        write_simulated(device, TOTAL_MIB, [(GAME_PID, GAME_MIB)])
        viewport(page, 1280, 800)


def test_with_an_api_key_the_page_asks_for_it_and_keeps_it_for_the_tab(
    tiny_model: Path, browser: Any, tmp_path: Path, daemons: list[StrataDaemon]
) -> None:
    key = "sk-page-test-key"
    d = StrataDaemon(tmp_path, ["--model", str(tiny_model), "--device", "cpu"],
                     env={"STRATA_API_KEY": key})  # fmt: skip
    daemons.append(d)
    browser.get(d.url + "/")  # the page itself needs no key
    wait_until(lambda: browser.find_element("id", "key-form").is_displayed(), "the key asked for")
    assert "API key" in text(browser, "link")
    browser.find_element("id", "key-input").send_keys("wrong")
    browser.find_element("css selector", "#key-form button").click()
    wait_until(lambda: "invalid API key" in text(browser, "key-error"), "a wrong key refused")
    browser.find_element("id", "key-input").send_keys(key)
    browser.find_element("css selector", "#key-form button").click()
    wait_until(lambda: text(browser, "state") == "ready", "the status, read with the key")
    wait_until(lambda: text(browser, "link") == "live", "the status stream is live")
    assert not browser.find_element("id", "key-form").is_displayed()
    kept = browser.execute_script("return [sessionStorage.length, localStorage.length]")
    assert kept == [1, 0]  # in this tab's session storage only (the key; no chat yet)
    assert key not in browser.page_source
