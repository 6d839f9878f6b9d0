// Strata's page: who holds the GPU, and a chat with the served model. Plain JavaScript, no
// framework, nothing from the network but this server. Every API call goes through fetch() with
// the Authorization header when the server wants a key (EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const KEY_STORE = "strata-api-key"; // sessionStorage: kept for this tab only
const CHAT_STORE = "strata-chat";
const MAX_SAMPLES = 4000; // events and history together, oldest dropped first

// the layers of the picture, bottom to top; value(status) in MiB
const LAYERS = [
  { id: "core", name: "cache core", value: (s) => s.core_mib },
  { id: "tail", name: "elastic tail", value: (s) => Math.max(0, s.cache_mib - s.core_mib) },
  { id: "kv", name: "K/V", value: (s) => s.kv_mib || 0, optional: true },
  { id: "engine", name: "engine", value: (s) => engineMib(s), optional: true },
  { id: "tenants", name: "other programs", value: (s) => s.tenants_mib || 0, device: true },
  { id: "kept", name: "kept room", value: (s) => keptMib(s), device: true },
  { id: "free", name: "free", value: (s) => Math.max(0, (s.free_mib || 0) - keptMib(s)), device: true },
];

function engineMib(s) {
  if (s.ours_mib == null) return 0;
  return Math.max(0, s.ours_mib - s.cache_mib - (s.kv_mib || 0));
}

function keptMib(s) {
  // room the policy keeps free (reserve, holds, leases not yet taken): part of the free memory
  return Math.max(0, Math.min(s.room_kept_mib || 0, s.free_mib || 0));
}

const page = {
  samples: [], // {t: ms on this clock, s: status}
  status: null,
  windowS: 300,
};

// -- the key and the API ----------------------------------------------------------------------

let keyWaiters = [];

function apiKey() {
  return sessionStorage.getItem(KEY_STORE);
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

class ApiError extends Error {}

// The key form: shown after a 401; resolves once the user gave a key.
function needKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  setLink("needs the API key", "link-down");
  $("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) {
    $("key-error").textContent = "enter the key (the daemon's api_key)";
    return;
  }
  sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  $("key-form").hidden = true;
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((w) => w());
});

// The error text of a failed response: the server's own message where it sent one.
async function errorText(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    /* not JSON: the status line says it */
  }
  return `HTTP ${res.status} ${res.statusText}`.trim();
}

// fetch() with the key; a 401 asks for the key and tries again.
async function api(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const res = await fetch(path, opts);
    if (res.status !== 401) return res;
    await needKey(await errorText(res));
  }
}

// -- the status stream ------------------------------------------------------------------------

function setLink(text, cls) {
  const el = $("link");
  el.textContent = text;
  el.className = "badge " + cls;
}

// Server-Sent Events over fetch: calls onEvent(name, data, id) per event; comments are skipped.
async function readEvents(res, onEvent, signal) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    if (signal && signal.aborted) return;
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      let id = null;
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = value;
        else if (field === "data") data.push(value);
        else if (field === "id") id = value;
      }
      if (data.length) onEvent(name, data.join("\n"), id);
    }
  }
}

function onStatusEvent(name, data) {
  const body = JSON.parse(data);
  if (name === "history") {
    // the server's clock to ours, from the moment it sent the history
    const offset = Date.now() - body.now_us / 1000;
    const old = body.samples.map((x) => ({ t: x.at_us / 1000 + offset, s: x.status }));
    const newest = old.length ? old[old.length - 1].t : -Infinity;
    page.samples = old.concat(page.samples.filter((x) => x.t > newest));
  } else if (name === "status") {
    page.samples.push({ t: Date.now(), s: body });
    if (page.samples.length > MAX_SAMPLES) page.samples.splice(0, page.samples.length - MAX_SAMPLES);
    page.status = body;
    showStatus(body);
  }
  draw();
}

async function follow() {
  let wait = 500;
  for (;;) {
    try {
      const res = await api("/v1/vram/events", { cache: "no-store" });
      if (!res.ok) throw new ApiError(await errorText(res));
      setLink("live", "link-live");
      wait = 500;
      await readEvents(res, onStatusEvent);
      setLink("the daemon stopped; reconnecting…", "link-down");
    } catch (e) {
      setLink("reconnecting: " + e.message, "link-down");
    }
    await new Promise((r) => setTimeout(r, wait));
    wait = Math.min(wait * 2, 10000);
  }
}

// -- what the status says ---------------------------------------------------------------------

function mib(n) {
  return n == null ? "–" : `${Math.round(n).toLocaleString("en-US")} MiB`;
}

function showStatus(s) {
  $("model").textContent = s.model || "";
  const state = $("state");
  state.textContent = s.state;
  state.className = "badge state-" + s.state;
  const mon = s.monitor || {};
  $("device").textContent = s.device + (mon.healthy === false && mon.problem ? ` (${mon.problem})` : "");
  const watched = s.total_mib != null;
  // no GPU at all (the CPU, no VRAM monitor): no GPU memory to draw, and no reserve the daemon
  // would accept (it refuses every one above 0 MiB)
  const noGpu = s.vram_requests === "refused";
  $("memory-title").textContent = noGpu ? "Memory (CPU only, no GPU)" : "GPU memory";
  $("no-monitor").hidden = watched;
  $("no-monitor").textContent = watched
    ? ""
    : noGpu
      ? "Strata computes on the CPU and holds no VRAM: the picture shows its expert cache in RAM."
      : "No VRAM monitor: only Strata's own cache is known, not what other programs hold.";
  $("reserve-section").hidden = noGpu;
  $("hit-rate").textContent = s.hit_rate == null ? "–" : `${(s.hit_rate * 100).toFixed(1)} %`;
  $("resizes").textContent = String(s.resizes);
  $("busy").textContent = s.busy ? `generating${s.queued ? `, ${s.queued} waiting` : ""}` : "idle";
  const pending = s.reserve_state === "pending";
  $("reserve-now").textContent = mib(s.reserve_mib) + (pending ? " (not met yet)" : "");
  $("reserve-now").title = pending ? s.reserve_message || "" : "";
  $("borrowed").textContent = s.leases.length ? `(${mib(s.borrowed_mib)} lent)` : "";
  showLegend(s);
  showLeases(s.leases);
}

function visibleLayers(s) {
  const watched = s.total_mib != null;
  return LAYERS.filter((l) => (watched || !l.device) && (!l.optional || l.value(s) > 0));
}

function showLegend(s) {
  const ul = $("legend");
  ul.replaceChildren();
  for (const l of visibleLayers(s).slice().reverse()) {
    const li = document.createElement("li");
    li.dataset.layer = l.id;
    const sw = document.createElement("span");
    sw.className = "swatch l-" + l.id;
    const name = document.createElement("span");
    name.textContent = l.name;
    const value = document.createElement("span");
    value.className = "value";
    value.textContent = mib(l.value(s));
    li.append(sw, name, value);
    ul.append(li);
  }
  if (s.total_mib != null) {
    const li = document.createElement("li");
    const name = document.createElement("span");
    name.className = "muted";
    name.textContent = `device ${s.device}`;
    const value = document.createElement("span");
    value.className = "value";
    value.textContent = mib(s.total_mib);
    li.append(name, value);
    ul.append(li);
  }
}

function ago(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min ago`;
}

function showLeases(leases) {
  const body = $("lease-rows");
  body.replaceChildren();
  for (const l of leases) {
    const tr = document.createElement("tr");
    tr.dataset.cookie = String(l.cookie);
    tr.title = `cookie ${l.cookie}, ${l.owner}${l.pid != null ? ", pid " + l.pid : ""}`;
    const since = new Date(l.since_us / 1000);
    const cells = [l.app_id || "(unnamed)", l.reason || "", String(l.mib), ""];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (i === 2) td.className = "num";
      if (i === 3) {
        td.className = "since";
        td.dataset.since = String(since.getTime());
        td.textContent = `${since.toLocaleTimeString()} (${ago(Date.now() - since.getTime())})`;
      }
      tr.append(td);
    });
    body.append(tr);
  }
  $("no-leases").hidden = leases.length > 0;
}

// -- the pictures -----------------------------------------------------------------------------

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.append(node);
  return node;
}

function text(parent, x, y, content, anchor) {
  const t = el("text", { x, y, class: "axis-text", "text-anchor": anchor || "start" }, parent);
  t.textContent = content;
  return t;
}

function inWindow(now) {
  const start = now - page.windowS * 1000;
  const all = page.samples;
  let first = 0;
  while (first < all.length - 1 && all[first + 1].t <= start) first++;
  return { start, samples: all.slice(first) };
}

function timeLabels(svg, x, start, now, bottom) {
  const stepS = page.windowS <= 60 ? 15 : 60;
  for (let back = 0; back <= page.windowS; back += stepS * (page.windowS > 300 ? 2 : 1)) {
    const px = x(now - back * 1000);
    const label = back === 0 ? "now" : back < 60 ? `−${back} s` : `−${back / 60} min`;
    text(svg, px, bottom + 14, label, back === 0 ? "end" : "middle");
  }
}

// An emptied SVG picture sized to its box: {svg, W, H} in CSS pixels.
function canvas(svgId, boxId, minHeight) {
  const svg = $(svgId);
  const box = $(boxId);
  const W = Math.max(200, box.clientWidth);
  const H = Math.max(minHeight, box.clientHeight);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  return { svg, W, H };
}

function drawMemory(now) {
  const { svg, W, H } = canvas("chart", "chart-box", 120);
  const s = page.status;
  const { start, samples } = inWindow(now);
  if (!s || !samples.length) {
    text(svg, W / 2, H / 2, "waiting for the daemon's status…", "middle");
    return;
  }
  const left = 58;
  const right = W - 8;
  const top = 8;
  const bottom = H - 20;
  const layers = LAYERS.filter((l) => s.total_mib != null || !l.device);
  // the device's memory is the scale; without a monitor, the largest the cache can be (a
  // sample read between a resize and the next look at the device may add up to a little more:
  // clipped at the top)
  let max = s.total_mib;
  if (max == null) {
    max = s.max_cache_mib;
    for (const p of samples) max = Math.max(max, layers.reduce((a, l) => a + l.value(p.s), 0));
  }
  max = Math.max(1, max);
  const x = (t) => left + ((Math.max(t, start) - start) / (now - start)) * (right - left);
  const y = (v) => Math.max(top, bottom - (v / max) * (bottom - top));
  // each sample holds until the next one (the last until now): steps
  const edges = samples.map((p, i) => [x(p.t), i + 1 < samples.length ? x(samples[i + 1].t) : right]);
  const base = samples.map(() => 0);
  for (const l of layers) {
    const lower = base.slice();
    samples.forEach((p, i) => (base[i] += l.value(p.s)));
    if (base.every((v, i) => v === lower[i])) continue;
    let d = "";
    samples.forEach((p, i) => {
      const [x0, x1] = edges[i];
      d += `${i ? "L" : "M"}${x0.toFixed(1)},${y(base[i]).toFixed(1)}L${x1.toFixed(1)},${y(base[i]).toFixed(1)}`;
    });
    for (let i = samples.length - 1; i >= 0; i--) {
      const [x0, x1] = edges[i];
      d += `L${x1.toFixed(1)},${y(lower[i]).toFixed(1)}L${x0.toFixed(1)},${y(lower[i]).toFixed(1)}`;
    }
    el("path", { d: d + "Z", class: "layer l-" + l.id, "data-layer": l.id }, svg);
  }
  // axes and labels
  el("line", { x1: left, y1: bottom, x2: right, y2: bottom, class: "axis" }, svg);
  el("line", { x1: left, y1: top, x2: left, y2: bottom, class: "axis" }, svg);
  for (const frac of [0, 0.5, 1]) {
    text(svg, left - 6, y(max * frac) + 4, mib(max * frac), "end");
  }
  timeLabels(svg, x, start, now, bottom);
  // resizes, marked on the time axis where the counter moved
  for (let i = 1; i < samples.length; i++) {
    if (samples[i].s.resizes > samples[i - 1].s.resizes && samples[i].t >= start) {
      const px = x(samples[i].t);
      el("line", { x1: px, y1: top, x2: px, y2: bottom, class: "resize-mark" }, svg);
      el("path", { d: `M${px - 4},${bottom + 6}L${px + 4},${bottom + 6}L${px},${bottom}Z`, class: "resize-tick" }, svg);
    }
  }
}

// tokens generated up to time t (the counter of the last sample at or before t)
function tokensAt(samples, t) {
  let n = null;
  for (const p of samples) {
    if (p.t > t) break;
    n = p.s.generated_tokens;
  }
  return n == null ? (samples.length ? samples[0].s.generated_tokens : 0) : n;
}

function tokPerS(now, span) {
  const samples = page.samples;
  if (!samples.length || samples[samples.length - 1].s.generated_tokens == null) return null;
  return (tokensAt(samples, now) - tokensAt(samples, now - span * 1000)) / span;
}

function drawSpeed(now) {
  const { svg, W, H } = canvas("speed", "speed-box", 40);
  const { start, samples } = inWindow(now);
  if (!samples.length) return;
  const left = 58;
  const right = W - 8;
  const bottom = H - 4;
  const top = 4;
  const bucket = Math.max(2, page.windowS / 120) * 1000;
  const rates = [];
  for (let t = start; t < now; t += bucket) {
    const end = Math.min(now, t + bucket);
    rates.push([end, ((tokensAt(samples, end) - tokensAt(samples, t)) * 1000) / (end - t)]);
  }
  const max = Math.max(1, ...rates.map((r) => r[1]));
  const x = (t) => left + ((t - start) / (now - start)) * (right - left);
  const y = (v) => bottom - (v / max) * (bottom - top);
  const line = rates.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`).join("");
  el("path", { d: `${line}L${x(now).toFixed(1)},${bottom}L${left},${bottom}Z`, class: "speed-area" }, svg);
  el("path", { d: line, class: "speed-line" }, svg);
  el("line", { x1: left, y1: bottom, x2: right, y2: bottom, class: "axis" }, svg);
  text(svg, left - 6, top + 10, `${max.toFixed(max < 10 ? 1 : 0)} tok/s`, "end");
}

function draw() {
  const now = Date.now();
  drawMemory(now);
  drawSpeed(now);
  const rate = tokPerS(now, 5);
  $("tok-s").textContent = rate == null ? "–" : rate.toFixed(1);
  for (const td of document.querySelectorAll("td.since")) {
    const since = Number(td.dataset.since);
    td.textContent = `${new Date(since).toLocaleTimeString()} (${ago(now - since)})`;
  }
}

$("window").addEventListener("change", (e) => {
  page.windowS = Number(e.target.value);
  draw();
});
window.addEventListener("resize", draw);

// -- the reserve ------------------------------------------------------------------------------

async function setReserve(value) {
  const result = $("reserve-result");
  const buttons = [$("reserve-set"), $("reserve-clear")];
  result.className = "result";
  result.textContent = "asking the daemon…";
  buttons.forEach((b) => (b.disabled = true));
  try {
    const res = await api("/v1/vram", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ reserve_mib: value }),
    });
    if (!res.ok) throw new ApiError(await errorText(res));
    const body = await res.json();
    // "pending": set and in force, the room not free yet (the status's reserve_state)
    if (body.result.how === "pending") result.className = "result pending";
    result.textContent = body.result.message;
  } catch (e) {
    result.className = "result error";
    result.textContent = "reserve not set: " + e.message;
  } finally {
    buttons.forEach((b) => (b.disabled = false));
  }
}

$("reserve-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const raw = $("reserve-input").value.trim();
  if (raw === "") {
    const result = $("reserve-result");
    result.className = "result error";
    result.textContent = "reserve not set: enter the MiB to keep free (a whole number, 0 clears it)";
    return;
  }
  // the number as typed: the server checks it and says what is wrong
  const n = Number(raw);
  setReserve(Number.isFinite(n) ? n : raw);
});
$("reserve-clear").addEventListener("click", () => setReserve(0));

// -- the chat ---------------------------------------------------------------------------------

const chat = {
  messages: JSON.parse(sessionStorage.getItem(CHAT_STORE) || "[]"), // {role, content, reasoning, note}
  abort: null,
};

function saveChat() {
  sessionStorage.setItem(CHAT_STORE, JSON.stringify(chat.messages));
}

function messageNode(m) {
  const div = document.createElement("div");
  div.className = "msg msg-" + m.role;
  // a thinking model's thought (reasoning_content), shown apart from the answer
  const thought = document.createElement("span");
  thought.className = "msg-thought";
  thought.textContent = m.reasoning || "";
  thought.hidden = !m.reasoning;
  const body = document.createElement("span");
  body.className = "msg-text";
  body.textContent = m.content;
  div.append(thought, body);
  if (m.note) {
    const note = document.createElement("span");
    note.className = "msg-note";
    note.textContent = m.note;
    div.append(note);
  }
  return div;
}

function showChat() {
  const box = $("messages");
  box.replaceChildren();
  if (!chat.messages.length) {
    const empty = document.createElement("p");
    empty.className = "msg-empty";
    empty.textContent = "Ask the model something.";
    box.append(empty);
  }
  chat.messages.forEach((m) => box.append(messageNode(m)));
  box.scrollTop = box.scrollHeight;
}

// A number field: left empty it is left out (the daemon's default applies); otherwise the
// number, or the text as typed so that the server names what is wrong with it.
function field(id) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const n = Number(raw);
  return Number.isFinite(n) ? n : raw;
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = chat.messages
    .filter((m) => m.role === "user" || (m.role === "assistant" && m.content))
    .map((m) => ({ role: m.role, content: m.content }));
  const body = {
    model: page.status ? page.status.model : "",
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const [name, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"], ["seed", "seed"]]) {
    const v = field(id);
    if (v !== undefined) body[name] = v;
  }
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || chat.abort) return;
  $("chat-error").textContent = "";
  chat.messages.push({ role: "user", content: prompt });
  const reply = { role: "assistant", content: "", note: "" };
  chat.messages.push(reply);
  $("prompt").value = "";
  showChat();
  const node = $("messages").lastElementChild;
  const textNode = node.querySelector(".msg-text");
  const thoughtNode = node.querySelector(".msg-thought");
  const controller = new AbortController();
  chat.abort = controller;
  setBusy(true);
  const t0 = performance.now();
  let first = null;
  let usage = null;
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!res.ok) throw new ApiError(await errorText(res));
    let finish = null;
    await readEvents(
      res,
      (_name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        if (choice.delta && choice.delta.reasoning_content) {
          if (first === null) first = performance.now();
          reply.reasoning = (reply.reasoning || "") + choice.delta.reasoning_content;
          thoughtNode.textContent = reply.reasoning;
          thoughtNode.hidden = false;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          reply.content += choice.delta.content;
          textNode.textContent = reply.content;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      },
      controller.signal,
    );
    const took = (performance.now() - t0) / 1000;
    const parts = [finish ? `finish: ${finish}` : "no finish"];
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (usage && first !== null && usage.completion_tokens > 1) {
      const decodeS = (performance.now() - first) / 1000;
      if (decodeS > 0) parts.push(`${((usage.completion_tokens - 1) / decodeS).toFixed(1)} tok/s`);
    }
    parts.push(`${took.toFixed(1)} s`);
    reply.note = parts.join(", ");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note = "stopped";
    } else {
      reply.note = "failed";
      $("chat-error").textContent = e.message;
    }
  } finally {
    chat.abort = null;
    setBusy(false);
    if (!reply.content && !reply.reasoning && reply.note === "failed") {
      // nothing came back: the message goes back into the box, to send again once fixed
      chat.messages.splice(-2, 2);
      if (!$("prompt").value) $("prompt").value = prompt;
    }
    saveChat();
    showChat();
  }
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => {
  if (chat.abort) chat.abort.abort(); // the daemon sees the connection close and cancels
});
$("new-chat").addEventListener("click", () => {
  if (chat.abort) chat.abort.abort();
  chat.messages = [];
  saveChat();
  showChat();
});

// -- start ------------------------------------------------------------------------------------

showChat();
draw();
setInterval(draw, 1000);
follow();
