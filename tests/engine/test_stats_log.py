"""The stats line the server logs every interval while it works (``engine/stats_log.py``): throughputs and the hit
rate over the interval from the engine's cumulative counters, the current requests and KV usage, silence while
idle but one line when the work ends."""
from pegainfer.engine.stats_log import StatsLogger


class Readings:
    """``stats()`` and the clock of a scripted run: each ``line()`` call reads the next (time, stats) pair."""

    def __init__(self, readings):
        self.readings, self.i = readings, -1

    def clock(self):
        self.i += 1
        return self.readings[self.i][0]

    def stats(self):
        return self.readings[self.i][1]


def stats(prompt=0, generated=0, running=0, waiting=0, pending=0, used=0, total=100, queries=0, hits=0,
          preempted=0):
    return {"prompt_tokens_computed": prompt, "generation_tokens": generated, "running": running,
            "waiting": waiting, "pending": pending, "kv_pages_used": used, "kv_pages_total": total,
            "prefix_cache_queries": queries, "prefix_cache_hits": hits, "num_preemptions": preempted,
            "state": "ready"}


def test_lines_over_each_interval_then_one_when_idle():
    r = Readings([
        (0.0, {"state": "loading", "pending": 0}),                         # before the model loaded: no keys
        (10.0, stats()),                                                   # loaded, idle: nothing to say
        (20.0, stats(prompt=4000, generated=1000, running=8, waiting=2, pending=1, used=25, queries=4000,
                     hits=1000)),
        (25.0, stats(prompt=4000, generated=6000, running=8, used=30, queries=4000, hits=1000, preempted=2)),
        (35.0, stats(prompt=4000, generated=6500, used=0, queries=4000, hits=1000, preempted=2)),   # work ended
        (45.0, stats(prompt=4000, generated=6500, queries=4000, hits=1000, preempted=2)),          # idle
        (55.0, stats(prompt=4000, generated=6500, queries=4000, hits=1000, preempted=2)),
    ])
    log = StatsLogger(r.stats, interval=10.0, clock=r.clock)
    assert log.line() is None           # the first reading: where the first interval starts
    assert log.line() is None           # idle
    assert log.line() == ("Avg prompt throughput: 400.0 tokens/s, Avg generation throughput: 100.0 tokens/s, "
                          "Running: 8 reqs, Waiting: 3 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert log.line() == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1000.0 tokens/s, "
                          "Running: 8 reqs, Waiting: 0 reqs, GPU KV cache usage: 30.0%, Prefix cache hit rate: 0.0%, "
                          "Preempted: 2 reqs")
    assert log.line() == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                          "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    # the first idle interval: one line of zeros (as vLLM writes), then silence
    assert log.line() == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
                          "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    assert log.line() is None


def test_a_request_that_starts_and_ends_within_one_interval_is_reported():
    done = stats(prompt=128, generated=256)
    r = Readings([(0.0, stats()), (10.0, done), (20.0, done), (30.0, done)])
    log = StatsLogger(r.stats, interval=10.0, clock=r.clock)
    assert log.line() is None
    assert log.line().startswith("Avg prompt throughput: 12.8 tokens/s, Avg generation throughput: 25.6 tokens/s, "
                                 "Running: 0 reqs")
    assert log.line().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s")
    assert log.line() is None


def test_the_thread_logs_every_interval_and_stops():
    import threading
    lines, busy = [], threading.Event()
    counter = {"n": 0}

    def reading():
        counter["n"] += 1
        return stats(generated=counter["n"] * 10, running=1)

    def emit(text):
        lines.append(text)
        if len(lines) >= 3:
            busy.set()

    log = StatsLogger(reading, interval=0.01, emit=emit).start()
    assert busy.wait(10), lines
    log.stop()
    n = len(lines)
    assert all(line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: ") for line in lines)
    assert not log._thread.is_alive() and len(lines) == n
