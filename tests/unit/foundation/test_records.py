"""The shared wire records: validation at construction and the msgpack codec."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import numpy as np
import pytest

from astraflow.errors import ValidationError
from astraflow.records import (
    Batch,
    LeaseRequest,
    Sample,
    SubmitRequest,
    TakeBatchRequest,
    pack,
    parse,
    unpack,
    wire_schemas,
)


def make_sample(n: int = 12, prompt: int = 4, version: int = 3, **kw: Any) -> Sample:
    mask = np.r_[np.zeros(prompt), np.ones(n - prompt)]
    fields: dict[str, Any] = {
        "policy": "solver",
        "task_id": "t-1",
        "group_id": "t-1",
        "token_ids": np.arange(n) % 7,
        "loss_mask": mask,
        "logprobs": -np.linspace(0.1, 2.0, n) * mask,
        "versions": np.where(mask > 0, version, -1),
        "reward": 1.0,
        "meta": {"turns": 1},
    }
    fields.update(kw)
    return Sample(**fields)


def test_msgpack_round_trip_is_exact_and_compact() -> None:
    req = SubmitRequest(node_id="n1", task_id="t-1", attempt=2, secret="ab" * 16,
                        samples=[make_sample()] * 3)  # fmt: skip
    data = pack(req)
    back = unpack(SubmitRequest, data)
    assert back == req
    assert back.samples[0].token_ids.dtype == np.int32
    assert back.samples[0].logprobs.dtype == np.float32
    # arrays travel as packed bytes, not lists: 12 tokens * (4+1+4+4) bytes per sample
    assert len(data) < 3 * (12 * 13 + 200)


def test_json_form_uses_lists() -> None:
    s = make_sample()
    body = json.loads(s.model_dump_json())
    assert body["token_ids"] == list(range(7)) + list(range(5))
    assert parse(Sample, body) == s


@pytest.mark.parametrize("context", [4, 200])  # short and long arrays take different paths
def test_derived_fields(context: int) -> None:
    s = make_sample(n=context + 8, prompt=context,
                    versions=np.r_[[-1] * context, [5, 5, 4, 6, 6, 6, 6, 6]])  # fmt: skip
    assert s.num_tokens == context + 8
    assert s.num_generated == 8
    assert s.behaviour_version == 4
    assert s.staleness(7) == 3
    assert s.staleness(2) == 0
    untrained = make_sample(n=context + 8, prompt=context + 8, versions=[-1] * (context + 8))
    assert untrained.behaviour_version == -1 and untrained.staleness(9) == 0
    with pytest.raises(ValidationError, match="token id 6 is outside"):
        s.check_vocab(6)
    s.check_vocab(7)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"reward": float("nan")}, "reward"),
        ({"reward": float("inf")}, "reward"),
        ({"logprobs": [0.0] * 3}, "logprobs"),
        ({"logprobs": [float("nan")] * 12}, "logprobs"),
        ({"loss_mask": [2] * 12}, "loss_mask"),
        ({"versions": [-2] * 12}, "versions"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [-1] * 12}, "token_ids"),
        ({"token_ids": [1.5] * 12}, "token_ids"),
        ({"token_ids": b"\x00\x01\x02"}, "token_ids"),
        ({"policy": "no spaces allowed"}, "policy"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_sample_names_the_field(change: dict[str, Any], field: str) -> None:
    raw = json.loads(make_sample().model_dump_json())
    raw.update(change)
    with pytest.raises(ValidationError) as info:
        parse(Sample, raw)
    assert info.value.field == field
    assert field in str(info.value)


def test_arrays_of_the_wire_dtype_are_still_checked_and_copied() -> None:
    # a workflow builds samples from int32 / uint8 / float32 arrays: they skip the conversion,
    # not the checks, and the sample owns its own copy
    tokens = np.arange(12, dtype=np.int32) % 7
    sample = make_sample(token_ids=tokens, loss_mask=np.r_[[0] * 4, [1] * 8].astype(np.uint8))
    tokens[0] = 5
    assert sample.token_ids[0] == 0 and sample.token_ids.dtype == np.int32
    bad: list[tuple[dict[str, Any], str]] = [
        ({"token_ids": np.full(12, -1, dtype=np.int32)}, "token_ids"),
        ({"token_ids": np.zeros((3, 4), dtype=np.int32)}, "token_ids"),
        ({"loss_mask": np.full(12, 2, dtype=np.uint8)}, "loss_mask"),
        ({"logprobs": np.full(12, np.nan, dtype=np.float32)}, "logprobs"),
        ({"versions": np.full(12, -2, dtype=np.int32)}, "versions"),
        ({"versions": np.zeros(5, dtype=np.int32)}, "versions"),
    ]
    for change, field in bad:
        with pytest.raises(ValidationError) as info:
            parse(Sample, {**make_sample().model_dump(), **change})
        assert info.value.field == field, change


# short arrays are checked as Python lists, long ones in numpy
@pytest.mark.parametrize("n", [12, 64, 65, 300])
@pytest.mark.parametrize("form", ["arrays", "msgpack"])
def test_one_bad_entry_anywhere_is_found_in_short_and_long_arrays(n: int, form: str) -> None:
    good = make_sample(n=n, prompt=4)
    assert unpack(Sample, pack(good)) == good

    def with_entry(field: str, at: int, value: Any) -> dict[str, Any]:
        column = getattr(good, field).copy()
        column[at] = value
        return {**good.model_dump(), field: column}

    bad = [
        ("token_ids", n - 1, -3),
        ("loss_mask", n // 2, 2),
        ("logprobs", n - 1, np.nan),
        ("logprobs", 5, np.inf),
        ("logprobs", n - 2, -np.inf),
        ("versions", n - 1, -2),
    ]
    for field, at, value in bad:
        fields = with_entry(field, at, value)
        with pytest.raises(ValidationError) as info:
            if form == "arrays":
                parse(Sample, fields)
            else:  # what a node sends: the arrays as packed bytes
                packed = {
                    k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in fields.items()
                }
                unpack(Sample, msgpack.packb(packed, use_bin_type=True))
        assert info.value.field == field, (field, at, value)
    # the record owns its arrays: not a view of the buffer it was decoded from
    body = bytearray(pack(good))
    back = unpack(Sample, body)
    body[:] = bytes(len(body))
    assert back == good and back.token_ids.flags.writeable


def test_vocab_check() -> None:
    s = make_sample()
    s.check_vocab(7)
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        s.check_vocab(6)


def test_malformed_msgpack_is_a_validation_error() -> None:
    data = pack(SubmitRequest(node_id="n", task_id="t", attempt=0, secret="ab" * 16,
                              samples=[make_sample()]))  # fmt: skip
    with pytest.raises(ValidationError, match="msgpack"):
        unpack(SubmitRequest, data[:-3])
    with pytest.raises(ValidationError):
        unpack(Batch, data)


def test_request_cross_field_rules() -> None:
    with pytest.raises(ValidationError, match="min_samples"):
        parse(
            TakeBatchRequest,
            {"policy": "p", "trainer_version": 0, "min_samples": 9, "max_samples": 4},
        )
    with pytest.raises(ValidationError, match="workflows"):
        parse(LeaseRequest, {"node_id": "n", "capacity": 1, "workflows": []})


def test_records_are_immutable() -> None:
    s = make_sample()
    with pytest.raises(Exception, match="frozen"):
        s.reward = 2.0  # type: ignore[misc]


def test_every_wire_record_has_a_json_schema() -> None:
    schemas = wire_schemas()
    assert {"Task", "Sample", "Batch", "LeaseRequest", "PolicyVersion"} <= set(schemas)
    assert "token_ids" in schemas["Sample"]["properties"]


def _nested(levels: int, leaf: Any) -> Any:
    """``leaf`` under ``levels`` dict and list levels, alternating."""
    value = leaf
    for i in range(levels):
        value = {"k": value} if i % 2 else [value]
    return value


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"score": float("nan")}, r"value\.score: must be finite"),
        ({"a": [1.0, {"b": float("-inf")}]}, r"value\.a\.1\.b: must be finite"),
        ({"n": 2**63}, r"value\.n: integer .* outside the 64-bit range"),
        ({"n": [-(2**63)]}, r"value\.n\.0: integer .* outside the 64-bit range"),
        ({"deep": _nested(32, 1)}, r"nested more than 32 levels deep"),
        ({"x": np.float64("nan")}, r"value\.x: must be finite"),
    ],
)
def test_bad_meta_is_refused_naming_where(meta: dict[str, Any], message: str) -> None:
    raw = json.loads(make_sample().model_dump_json())
    with pytest.raises(ValidationError, match=message) as info:
        parse(Sample, {**raw, "meta": meta})
    assert info.value.field == "meta"


@pytest.mark.parametrize(
    "meta",
    [
        {"turns": 3, "finish_reason": "stop", "ok": True, "none": None, "t": 0.25},
        {"n": 2**63 - 1, "m": -(2**63) + 1, "nested": {"list": [1, "a", [2.5, None]]}},
        {"deep": _nested(31, 1)},
        {"np": np.float64(1.5), "tuple": (1, 2)},
    ],
)
def test_good_meta_passes_unchanged(meta: dict[str, Any]) -> None:
    raw = json.loads(make_sample().model_dump_json())
    assert parse(Sample, {**raw, "meta": meta}).meta == meta
