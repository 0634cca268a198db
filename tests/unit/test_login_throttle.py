"""The failed-login throttle: failures count per client address, and a key that already logged in from
an address keeps working while that address is locked (one proxy, many clients), but no new key does."""

from __future__ import annotations

import pytest

from tokenmill.server.errors import APIError
from tokenmill.server.security import ApiKeys, LoginThrottle, authenticate, authorization

KEYS = ApiKeys(["alice-key", "bob-key"])
PROXY = "10.0.0.1"


def _status(throttle: LoginThrottle, key: str, address: str = PROXY) -> int:
    try:
        authenticate(KEYS, throttle, address, f"Bearer {key}")
    except APIError as exc:
        return exc.status
    return 200


def _lock(throttle: LoginThrottle, address: str = PROXY) -> None:
    for _ in range(throttle.max_failures):
        assert _status(throttle, "guess", address) == 401


def test_bad_keys_lock_the_address_for_new_keys_right_or_wrong() -> None:
    throttle = LoginThrottle(max_failures=3)
    _lock(throttle)
    assert _status(throttle, "guess") == 429
    # Never seen from this address: refused unread, so a guess cannot tell a right key.
    assert _status(throttle, "bob-key") == 429


def test_a_key_that_logged_in_from_the_address_keeps_working_while_it_is_locked() -> None:
    throttle = LoginThrottle(max_failures=3)
    assert _status(throttle, "alice-key") == 200
    _lock(throttle)
    assert _status(throttle, "alice-key") == 200
    assert _status(throttle, "bob-key") == 429
    assert _status(throttle, "alice-key", "10.0.0.2") == 200  # other addresses are not locked


def test_a_known_key_does_not_unlock_guesses() -> None:
    throttle = LoginThrottle(max_failures=3)
    assert _status(throttle, "alice-key") == 200
    _lock(throttle)
    assert _status(throttle, "alice-key") == 200
    assert _status(throttle, "guess") == 429


def test_the_lock_has_retry_after() -> None:
    throttle = LoginThrottle(max_failures=1, window_s=30.0)
    _lock(throttle)
    with pytest.raises(APIError) as caught:
        authenticate(KEYS, throttle, PROXY, "Bearer guess")
    assert caught.value.code == "too_many_failed_logins"
    assert 1 <= int(caught.value.headers["Retry-After"]) <= 30


def test_without_keys_everyone_is_anonymous_and_nothing_is_counted() -> None:
    throttle = LoginThrottle(max_failures=1)
    for _ in range(3):
        assert authenticate(ApiKeys([]), throttle, PROXY, None) == "anonymous"


def test_x_api_key_counts_as_a_bearer_token() -> None:
    assert authorization([(b"x-api-key", b"k")]) == "Bearer k"
    assert authorization([(b"authorization", b"Bearer a"), (b"x-api-key", b"k")]) == "Bearer a"
    assert authorization([]) is None
