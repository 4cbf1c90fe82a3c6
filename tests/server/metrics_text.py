"""Reading ``GET /metrics`` in tests: the Prometheus text parsed into {sample name: {labels: value}}."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[str, dict[tuple, float]]:
    """``{"vllm:prompt_tokens_total": {(("model_name", "m"),): 12.0}, ...}`` (labels as sorted pairs)."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def scrape(http: httpx.Client) -> dict[str, dict[tuple, float]]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    return parse(r.text)


ABSENT = object()


def samples(metrics: dict, name: str, **labels) -> list[float]:
    """The samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return [v for key, v in metrics.get(name, {}).items() if want <= set(key)]


def present(metrics: dict, name: str, **labels) -> bool:
    """Whether ``/metrics`` exports a series of ``name`` with these labels."""
    return bool(samples(metrics, name, **labels))


def value(metrics: dict, name: str, default=ABSENT, **labels) -> float:
    """The one sample of ``name`` whose labels include ``labels``.  A missing series fails the test, unless a
    ``default`` is given for it."""
    found = samples(metrics, name, **labels)
    assert len(found) <= 1, (name, labels, metrics.get(name))
    if found:
        return found[0]
    assert default is not ABSENT, f"/metrics has no series {name} with labels {labels}"
    return default
