"""The lease book: cookies, owners, revocation, vanished owners, admission errors with numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strata.daemon.control.leases import (
    COOKIE_MAX,
    MAX_LEASES,
    MAX_LEASES_PER_OWNER,
    MAX_MIB,
    MAX_TEXT,
    InvalidArgument,
    LeaseBook,
    LeaseError,
    LeaseNotFound,
    NotEnoughVram,
    NotOwner,
    Timeout,
    max_freeable_mib,
)


def _add(book: LeaseBook, owner: str = ":1.7", mib: int = 1000, pid: int | None = 4242):
    return book.add(owner, pid, "org.example.Game", "textures", mib, 1_700_000_000_000_000, 300)


def test_cookies_are_unique_non_zero_and_never_reused() -> None:
    book = LeaseBook()
    seen = set()
    for i in range(50):
        lease = _add(book, owner=f":1.{7 + i // 10}")  # within the per-caller cap
        assert lease.cookie != 0 and lease.cookie not in seen
        seen.add(lease.cookie)
        if i % 2:  # returning leases must not free their cookies for reuse
            book.remove(lease.cookie, lease.owner)
    book.owner_vanished(":1.7")
    assert _add(book).cookie not in seen
    assert all(0 < c <= COOKIE_MAX for c in seen)


def test_a_lease_keeps_what_it_was_given() -> None:
    book = LeaseBook()
    lease = book.add(":1.9", 77, "app", "why", 2048, 123, None)
    assert (lease.owner, lease.pid, lease.app_id, lease.reason) == (":1.9", 77, "app", "why")
    assert (lease.mib, lease.since_us, lease.tenant_used_at_borrow_mib) == (2048, 123, None)
    assert book.get(lease.cookie) == lease
    assert book.leases() == [lease] and book.borrowed_mib == 2048


def test_owner_rules_return_and_revoke() -> None:
    book = LeaseBook()
    mine, theirs = _add(book, ":1.7", 1000), _add(book, ":1.8", 2000)
    with pytest.raises(NotOwner) as e:
        book.remove(theirs.cookie, ":1.7")
    assert str(theirs.cookie) in str(e.value) and ":1.7" in str(e.value) and ":1.8" in str(e.value)
    assert (e.value.cookie, e.value.caller, e.value.owner) == (theirs.cookie, ":1.7", ":1.8")
    assert book.leases() == [mine, theirs]  # a refused return changes nothing

    assert book.remove(mine.cookie, ":1.7") == mine
    assert book.remove(theirs.cookie, None) == theirs  # revoke: any owner
    assert book.leases() == [] and book.borrowed_mib == 0


@pytest.mark.parametrize("owner", [":1.7", None])
def test_a_cookie_that_is_not_there_is_named(owner: str | None) -> None:
    book = LeaseBook()
    lease = _add(book)
    book.remove(lease.cookie, owner)
    for cookie in (lease.cookie, 0, 999):
        with pytest.raises(LeaseNotFound, match=rf"\b{cookie}\b") as e:
            book.remove(cookie, owner)
        assert e.value.cookie == cookie


def test_a_cookie_that_is_not_a_number() -> None:
    with pytest.raises(InvalidArgument, match="'7'"):
        LeaseBook().remove("7", None)  # type: ignore[arg-type]


def test_owner_vanished_returns_all_its_leases_and_only_those() -> None:
    book = LeaseBook()
    a1, b, a2 = _add(book, ":1.7", 100), _add(book, ":1.8", 200), _add(book, ":1.7", 300)
    assert book.owner_vanished(":1.7") == [a1, a2]
    assert book.leases() == [b]
    assert book.owner_vanished(":1.7") == []
    assert book.owner_vanished(":1.99") == []


def test_reserve_and_holds() -> None:
    book = LeaseBook()
    assert book.reserve_mib == 0 and book.holds == {}
    book.set_reserve(4000)
    book.set_hold("gamemode", 3000)
    book.set_hold("gamemode", 3500)  # replaces
    book.holds["gamemode"] = 1  # a copy: the book is not changed behind its back
    view = book.view()
    assert (view.reserve_mib, dict(view.holds)) == (4000, {"gamemode": 3500})
    assert book.clear_hold("gamemode") is True and book.clear_hold("gamemode") is False
    book.set_reserve(0)
    assert (book.reserve_mib, book.holds) == (0, {})
    assert dict(view.holds) == {"gamemode": 3500}  # a view is a snapshot


def test_view_is_an_immutable_snapshot() -> None:
    book = LeaseBook()
    lease = _add(book, mib=1500)
    view = book.view()
    _add(book)
    assert view.leases == (lease,) and view.borrowed_mib == 1500
    with pytest.raises(TypeError):
        view.holds["x"] = 1  # type: ignore[index]


# value, fragment of the message
BAD_SIZES = [
    (0, "got 0"),
    (-5, "got -5"),
    (True, "got True"),
    (1.5, "got 1.5"),
    ("100", "got '100'"),
    (None, "got None"),
]


@pytest.mark.parametrize(("mib", "fragment"), BAD_SIZES)
def test_check_request_rejects_what_is_not_a_positive_whole_number(mib, fragment) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        LeaseBook.check_request(mib, 10_000)


def test_check_request_beyond_what_can_ever_be_freed_names_both_numbers() -> None:
    LeaseBook.check_request(10_000, 10_000)
    with pytest.raises(NotEnoughVram) as e:
        LeaseBook.check_request(10_001, 10_000)
    assert (e.value.requested_mib, e.value.max_freeable_mib) == (10_001, 10_000)
    assert "10001" in str(e.value) and "10000" in str(e.value)


def test_check_request_allow_zero_for_clearing_the_reserve() -> None:
    LeaseBook.check_request(0, 0, allow_zero=True)
    with pytest.raises(InvalidArgument):
        LeaseBook.check_request(-1, 100, allow_zero=True)
    with pytest.raises(NotEnoughVram):
        LeaseBook.check_request(1, 0, allow_zero=True)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda b: b.set_reserve(-1), "reserve.*got -1"),
        (lambda b: b.set_reserve(False), "reserve.*got False"),
        (lambda b: b.set_hold("", 100), "hold source"),
        (lambda b: b.set_hold("gamemode", -3), "gamemode.*got -3"),
        (lambda b: b.add(":1.7", 1, "a", "r", 0, 0, None), "lease size.*got 0"),
        (lambda b: b.add(":1.7", 1, "a", "r", True, 0, None), "lease size.*got True"),
        (lambda b: b.add("", 1, "a", "r", 10, 0, None), "owner"),
        (lambda b: b.add(":1.7", 0, "a", "r", 10, 0, None), "pid.*got 0"),
        (lambda b: b.add(":1.7", 1, "a", "r", 10, -1, None), "since_us.*got -1"),
        (lambda b: b.add(":1.7", 1, "a", "r", 10, 0, -2), "tenant usage.*got -2"),
        # sizes the status cannot carry (D-Bus int64 sums), strings that travel in every status
        (lambda b: b.set_reserve(2**64 - 1), "reserve: 18446744073709551615 MiB is beyond"),
        (lambda b: b.add(":1.7", 1, "a", "r", 2**63, 0, None), "lease size: .* is beyond"),
        (lambda b: b.set_hold("gamemode", 10**30), "is beyond the limit of 4294967296 MiB"),
        (lambda b: b.add(":1.7", 1, "a" * 200_000, "r", 10, 0, None), "app_id: 200000 char"),
        (lambda b: b.add(":1.7", 1, "a", "r" * (MAX_TEXT + 1), 10, 0, None), "reason: 257"),
        (lambda b: b.add(":1.7", 1, b"a" * 100_000, "r", 10, 0, None), r"app_id: .*characters\)"),
    ],
)
def test_book_rejects_bad_values_and_changes_nothing(call, fragment) -> None:
    book = LeaseBook()
    book.set_reserve(700)
    with pytest.raises(InvalidArgument, match=fragment):
        call(book)
    assert (book.reserve_mib, book.holds, book.leases()) == (700, {}, [])


def test_sizes_up_to_the_limit_are_taken() -> None:
    book = LeaseBook()
    book.set_reserve(MAX_MIB)
    _add(book, mib=MAX_MIB)
    LeaseBook.check_request(MAX_MIB, MAX_MIB)
    with pytest.raises(InvalidArgument, match="beyond the limit"):
        LeaseBook.check_request(MAX_MIB + 1, 2 * MAX_MIB)


def test_leases_are_capped_per_caller_and_in_all() -> None:
    book = LeaseBook()
    for _ in range(MAX_LEASES_PER_OWNER):
        _add(book, owner=":1.7")
    with pytest.raises(LeaseError, match=f":1.7 holds {MAX_LEASES_PER_OWNER} leases already"):
        _add(book, owner=":1.7")
    n = MAX_LEASES_PER_OWNER
    while n < MAX_LEASES:
        _add(book, owner=f":1.{100 + n // MAX_LEASES_PER_OWNER}")
        n += 1
    with pytest.raises(LeaseError, match=f"{MAX_LEASES} leases are held, at most {MAX_LEASES}"):
        _add(book, owner=":1.999")
    assert len(book.leases()) == MAX_LEASES
    book.owner_vanished(":1.7")
    _add(book, owner=":1.999")  # room again once a caller left


def test_max_freeable() -> None:
    assert max_freeable_mib(24576, 2048, 3000) == 19528
    assert max_freeable_mib(4000, 3000, 3000) == 0  # never negative
    with pytest.raises(ValueError, match=r"core_mib.*-1"):
        max_freeable_mib(24576, -1, 0)


def test_error_hierarchy_and_dbus_names() -> None:
    classes = [InvalidArgument, NotEnoughVram, LeaseNotFound, NotOwner, Timeout]
    assert all(issubclass(c, LeaseError) for c in classes)
    names = [c.dbus_name for c in [LeaseError, *classes]]
    assert names == [
        "org.strata.Error.Failed",
        "org.strata.Error.InvalidArgument",
        "org.strata.Error.NotEnoughVram",
        "org.strata.Error.LeaseNotFound",
        "org.strata.Error.NotOwner",
        "org.strata.Error.Timeout",
    ]
    assert len(set(names)) == len(names)


def test_cookie_space_is_never_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    book = LeaseBook()
    book._cookies.last = COOKIE_MAX - 1  # white-box: 4 billion borrows take too long to test
    assert _add(book).cookie == COOKIE_MAX
    with pytest.raises(LeaseError, match="cookies"):
        _add(book)


def test_the_book_and_the_policy_import_no_torch() -> None:
    code = (
        "import sys, strata.daemon.control.leases, strata.daemon.control.policy; "
        "bad = {'torch', 'asyncio', 'pynvml'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- several devices: one book per device, one cookie sequence and one set of limits -------------


def test_books_of_several_devices_share_cookies_and_limits() -> None:
    from strata.daemon.control.leases import Cookies

    cookies = Cookies()
    first, second = LeaseBook(cookies), LeaseBook(cookies)
    a, b, c = _add(first), _add(second), _add(first)
    assert [a.cookie, b.cookie, c.cookie] == [1, 2, 3], "a cookie names one lease of the daemon"
    assert [lease.cookie for lease in first.leases()] == [1, 3]
    assert second.leases() == [b] and second.borrowed_mib == 1000 and first.borrowed_mib == 2000
    # each book knows only its own leases: the other device's cookie is not found in it
    with pytest.raises(LeaseNotFound, match="2"):
        first.remove(2, None)
    # reserves and holds are each device's own
    second.set_reserve(4000)
    second.set_hold("gamemode", 500)
    assert first.reserve_mib == 0 and first.holds == {} and second.reserve_mib == 4000
    # the per-caller limit counts both books
    for _ in range(MAX_LEASES_PER_OWNER - 3):
        _add(second)
    with pytest.raises(LeaseError, match=f"holds {MAX_LEASES_PER_OWNER} leases already"):
        _add(first)
    assert cookies.count(":1.7") == MAX_LEASES_PER_OWNER
    # and so does the limit of all leases
    for i in range(MAX_LEASES - MAX_LEASES_PER_OWNER):
        _add(first if i % 2 else second, owner=f":2.{i // MAX_LEASES_PER_OWNER}")
    with pytest.raises(LeaseError, match=f"{MAX_LEASES} leases are held"):
        _add(second, owner=":3.1")
    # a returned lease's cookie is never handed out again, by either book
    first.remove(1, None)
    assert _add(first, owner=":3.1").cookie == MAX_LEASES + 1


def test_a_book_on_its_own_counts_only_its_leases() -> None:
    one, other = LeaseBook(), LeaseBook()
    assert _add(one).cookie == 1 and _add(other).cookie == 1
