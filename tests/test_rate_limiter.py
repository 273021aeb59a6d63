"""RateLimiter: a producer/consumer loop keeps samples per insert inside the band."""

import numpy as np
import pytest

from shared.replay.rate_limiter import RateLimiter, RateLimiterConfig


@pytest.mark.parametrize("seed", range(5))
def test_random_interleaving_stays_in_band(seed):
    rng = np.random.default_rng(seed)
    k, n, spi, min_size = 64, 32, 4.0, 520  # items per insert, per sample
    error_buffer = (k * spi + n) / 2  # the narrowest band that cannot deadlock: error_buffer=0's
    lim = RateLimiter(RateLimiterConfig(samples_per_insert=spi, min_size_to_sample=min_size),
                      insert_size=k, sample_size=n)
    assert lim.error_buffer == error_buffer
    bias = rng.uniform(0.05, 0.95)  # how often the producer gets the turn
    settled, peak = False, 0.0
    for _ in range(20_000):
        can_i, can_s = lim.can_insert(k), lim.can_sample(n)
        assert can_i or can_s, f"deadlock at error={lim.error}"
        if can_i and (not can_s or rng.random() < bias):
            warm = lim.size < min_size
            lim.on_insert(k)
            if not warm:
                assert lim.error <= lim.max_diff
        else:
            assert lim.size >= min_size
            lim.on_sample(n)
            assert lim.error >= lim.min_diff
        peak = max(peak, lim.error)
        # after the warm-up overshoot is worked off, the error never leaves the band
        settled = settled or (lim.size >= min_size and lim.error <= lim.max_diff)
        if settled:
            assert lim.min_diff <= lim.error <= lim.max_diff
    # the insert reaching min size (9 * 64 = 576 items) overshot: 576 * 4 > 2080 + 144
    assert peak == 576 * spi > lim.max_diff and settled
    # the measured ratio is the target up to the band's half-width over the inserts
    ratio = lim.samples / lim.inserts
    offset = spi * min_size
    assert abs(ratio - spi) <= (error_buffer + offset) / lim.inserts
    assert abs(ratio - spi) < 0.05


def test_narrow_band_is_reported_and_really_deadlocks():
    # spi 1, min size 1, buffer 10: min_diff = -9, max_diff = 11; inserts of 16 and
    # samples of 8 both block when -5 < error < -1, and check_no_deadlock says so.
    cfg = RateLimiterConfig(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=10.0)
    lim = RateLimiter(cfg)
    with pytest.raises(ValueError, match="at least 12"):
        lim.check_no_deadlock(insert_size=16, sample_size=8)
    assert lim.can_insert(16)  # below min size inserts are free, whatever their size
    lim.on_insert(16)  # error 16
    assert not lim.can_insert(16)
    assert lim.can_sample(8)
    lim.on_sample(8)
    lim.on_sample(8)  # error 0
    assert lim.can_sample(3)
    lim.on_sample(3)  # error -3
    assert not lim.can_insert(16) and not lim.can_sample(8)


def test_unthrottled_waits_only_for_min_size():
    lim = RateLimiter(RateLimiterConfig(min_size_to_sample=100))
    assert not lim.can_sample(1)
    lim.on_insert(99)
    assert not lim.can_sample(1) and lim.can_insert(10**6)
    lim.on_insert(1)
    lim.on_sample(10**6)
    assert lim.can_sample(10**6) and lim.can_insert(10**6)
    lim.on_delete(1)  # size 99 again: sampling waits
    assert not lim.can_sample(1)


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="samples_per_insert"):
        RateLimiter(RateLimiterConfig(samples_per_insert=-1.0))
    with pytest.raises(ValueError, match="min_size_to_sample"):
        RateLimiter(RateLimiterConfig(min_size_to_sample=0))
