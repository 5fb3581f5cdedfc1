"""Admission weighs requests in tokens: the request bound, the KV bound and the time bound, each refusing at once
with a Retry-After estimate; counts come back exactly when requests leave."""

from __future__ import annotations

import pytest

from actors.admission import MAX_RETRY_S, MIN_RETRY_S, Admission, AdmissionLimits, Overloaded


def admission(max_requests=4, kv_tokens=1000, max_queued_tokens=500, timeout_s=60.0) -> Admission:
    return Admission(AdmissionLimits(max_requests, kv_tokens, max_queued_tokens, timeout_s))


def test_request_bound():
    a = admission(max_requests=2)
    a.admit(10, 10)
    a.admit(10, 10)
    with pytest.raises(Overloaded) as err:
        a.admit(10, 10)
    assert err.value.reason == "requests" and err.value.retry_after_s == MIN_RETRY_S  # no rate measured yet
    a.release(10, 10, delivered=3)
    a.admit(10, 10)
    assert a.refused == {"requests": 1, "kv_tokens": 0, "deadline": 0}


def test_kv_bound_counts_prompt_and_max_tokens():
    a = admission(kv_tokens=1000, max_queued_tokens=500)
    a.admit(700, 300)  # exactly the KV cache
    a.admit(200, 300)  # the queue's 500
    with pytest.raises(Overloaded) as err:
        a.admit(1, 0)
    assert err.value.reason == "kv_tokens"
    a.rate = 100.0  # tokens per second: Retry-After is the time for the excess to drain, within bounds
    with pytest.raises(Overloaded) as err:
        a.admit(100, 200)
    assert err.value.retry_after_s == pytest.approx(300 / 100.0)
    a.release(700, 300, delivered=300)
    assert a.reserved == 500 and a.count == 1
    a.admit(400, 600)


def test_a_request_alone_is_never_refused_by_the_token_bounds():
    """The engine refuses what can never fit (400); admission only queues behind others."""
    a = admission(kv_tokens=100, max_queued_tokens=0, timeout_s=1.0)
    a.rate = 1.0
    a.admit(90, 500)
    assert a.count == 1


def test_time_bound_uses_the_measured_rate():
    a = admission(kv_tokens=10**6, timeout_s=60.0)
    a.admit(10, 1000)
    a.progress(200)  # 800 still owed
    a.rate = 20.0  # 800 / 20 = 40 s of work ahead
    a.admit(10, 300)  # 1100 / 20 = 55 s: within the deadline
    with pytest.raises(Overloaded) as err:
        a.admit(10, 200)  # 1300 / 20 = 65 s > 60 s
    assert err.value.reason == "deadline" and err.value.retry_after_s == pytest.approx(5.0)
    a.rate = 0.01
    with pytest.raises(Overloaded) as err:
        a.admit(10, 200)
    assert err.value.retry_after_s == MAX_RETRY_S
    a.release(10, 1000, delivered=200)
    a.release(10, 300, delivered=0)
    assert (a.count, a.reserved, a.owed) == (0, 0, 0)
