"""Trajectory filters and batch samplers: what each built-in keeps, drops and picks."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from astraflow.data_algorithms import FILTERS, SAMPLERS, BatchQuery, BatchSampler, GroupView
from astraflow.errors import PluginError
from fixtures.dataflow import make_group, make_sample

# --------------------------------------------------------------------------- filters


def test_dynamic_sampling_drops_zero_variance_groups() -> None:
    f = FILTERS.build("dynamic_sampling")
    assert f.check("solver", make_group("t", rewards=(0.0, 1.0, 1.0))) is None
    reason = f.check("solver", make_group("t", rewards=(1.0, 1.0)))
    assert reason is not None and reason.startswith("zero_variance") and "are 1" in reason
    assert f.check("solver", make_group("t", rewards=(0.0, 0.0, 0.0))) is not None
    assert f.metrics() == {"checked": 3.0, "dropped": 2.0, "dropped_zero_variance": 2.0}
    restored = FILTERS.build("dynamic_sampling")
    restored.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert restored.metrics() == f.metrics()


def test_length_filter_bounds() -> None:
    f = FILTERS.build({"type": "length", "max_tokens": 10, "min_generated": 2})
    assert f.check("solver", make_group("t", tokens=10, prompt=3)) is None
    assert f.check("solver", make_group("t", tokens=11)) == "too_long: 11 tokens > 10"
    short = f.check("solver", make_group("t", tokens=4, prompt=3))
    assert short == "too_short: 1 generated tokens < 2"
    g = FILTERS.build({"type": "length", "max_generated": 4, "drop_truncated": True})
    assert g.check("solver", make_group("t", tokens=8, prompt=3)) is not None
    cut = [make_sample("t", tokens=5).model_copy(update={"meta": {"finish_reason": "length"}})]
    assert g.check("solver", cut) == "truncated: a sample stopped at its length limit"
    with pytest.raises(PluginError, match="min_generated is larger"):
        FILTERS.build({"type": "length", "min_generated": 5, "max_generated": 2})


# --------------------------------------------------------------------------- samplers


def group(key: int, version: int = 0, source: str = "a", n: int = 2, **kw: Any) -> GroupView:
    fields: dict[str, Any] = {
        "key": key,
        "policy": "solver",
        "group_id": f"g{key}",
        "task_id": f"t{key}",
        "source": source,
        "num_samples": n,
        "num_tokens": 8 * n,
        "behaviour_version": version,
        "staleness": 0,
        "max_staleness": 2,
        "created_at": float(key),
        "reward_mean": 0.5,
        "reward_std": 0.5,
        "times_served": 0,
    }
    fields.update(kw)
    return GroupView(**fields)


def query(max_samples: int = 4, min_samples: int = 1) -> BatchQuery:
    return BatchQuery("solver", "trainer", 3, min_samples, max_samples)


def test_fifo_freshest_edf_orders() -> None:
    groups = [group(1, version=2), group(2, version=3), group(3, version=1), group(4, version=3)]
    assert SAMPLERS.build("fifo").choose(query(), groups, []) == [1, 2]
    assert SAMPLERS.build("freshest").choose(query(), groups, []) == [4, 2]
    # deadline = behaviour_version + max_staleness: the version-1 group expires first
    assert SAMPLERS.build("edf").choose(query(), groups, []) == [3, 1]
    no_version = [group(5, version=-1), group(6, version=3)]
    assert SAMPLERS.build("edf").choose(query(2), no_version, []) == [6]


def test_samplers_skip_groups_that_do_not_fit() -> None:
    groups = [group(1, n=3), group(2, n=2), group(3, n=1)]
    assert SAMPLERS.build("fifo").choose(query(4), groups, []) == [1, 3]


def test_replay_never_exceeds_its_ratio() -> None:
    fresh = [group(k) for k in range(1, 4)]
    kept = [group(k, times_served=1) for k in range(10, 20)]
    sampler = SAMPLERS.build({"type": "replay", "ratio": 0.5})
    keys = sampler.choose(query(8), fresh, kept)
    assert keys[:2] == [1, 2] and len(keys) == 4  # 4 fresh samples, then 4 replayed
    assert set(keys[2:]) <= {g.key for g in kept}
    # with little fresh data the ratio still holds: 2 fresh samples allow 2 replayed
    assert len(sampler.choose(query(8), fresh[:1], kept)) == 2
    assert sampler.choose(query(8), [], kept) == []  # replay alone never makes a batch
    recent = SAMPLERS.build({"type": "replay", "ratio": 0.25, "pick": "recent"})
    assert recent.choose(query(8), [group(k) for k in range(1, 4)], kept) == [1, 2, 3, 19]
    assert sampler.metrics()["replayed_groups"] == 3
    # a choice short of min_samples serves nothing and counts nothing (the service asks again
    # while the trainer waits: counting it would report groups replayed many times over)
    assert sampler.choose(query(8, min_samples=8), fresh[:1], kept) == []
    assert sampler.metrics() == {"batches": 2.0, "replayed_groups": 3.0, "fresh_groups": 3.0}


def test_mixing_serves_sources_by_weight() -> None:
    groups = [group(k, source="a") for k in range(20)] + [
        group(k, source="b") for k in range(20, 40)
    ]
    sampler = SAMPLERS.build({"type": "mixing", "weights": {"a": 3, "b": 1}})
    keys = sampler.choose(query(16), groups, [])
    by_source = Counter("a" if k < 20 else "b" for k in keys)
    assert by_source == {"a": 6, "b": 2}  # 12 and 4 samples: 3 to 1
    only_a = [group(k, source="a") for k in range(4)]
    strict = SAMPLERS.build({"type": "mixing", "weights": {"a": 1, "b": 1}, "fill": False})
    assert strict.choose(query(8), [*only_a, group(9, source="b")], []) == [0, 9, 1]
    filling = SAMPLERS.build({"type": "mixing", "weights": {"a": 1, "b": 1}})
    assert len(filling.choose(query(8), only_a, [])) == 4
    assert sampler.metrics()["served_a"] == 12
    with pytest.raises(PluginError, match="positive weight"):
        SAMPLERS.build({"type": "mixing", "weights": {"a": 0}})


def test_samplers_satisfy_the_protocol() -> None:
    for name in ("fifo", "freshest", "edf", "replay"):
        assert isinstance(SAMPLERS.build(name), BatchSampler)
    assert set(SAMPLERS.names()) == {"fifo", "freshest", "edf", "replay", "mixing"}
