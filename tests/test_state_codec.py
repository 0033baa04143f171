"""run.state_codec: a run's state round-trips exactly as data, and nothing else is read."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import msgspec
import numpy as np
import pytest
import torch

from mutualrl.exchange import Rollout
from mutualrl.exchange.codec import Delivery
from mutualrl.pacing import PacedRecord
from mutualrl.policies.samples import Sample
from mutualrl.run import state_codec
from mutualrl.run.state_codec import StateDecodeError, StateEncodeError, decode, encode
from mutualrl.tasks.base import Prompt


def rollout(prompt: str = "p") -> Rollout:
    return Rollout.create(
        prompt=prompt,
        completion="c",
        producer="a",
        tokenizer_id="t",
        token_ids=[1, 2, 3],
        logprobs=[-0.1, -0.2, -0.3],
        reward=0.5,
        verifier_id="v",
        policy_version=1,
        finish_reason="length",
    )


def test_a_runs_parts_round_trip_exactly():
    delivery = Delivery(kind="rollout", producer="a", producer_version=2, seq=7, record=rollout())
    sample = Sample(
        prompt=Prompt(text="first of a b:", answer="a", family="first"),
        prompt_ids=(1, 2),
        completion_ids=(3,),
        logprobs=(-0.5,),
        text="a",
        finish_reason="stop",
        group=0,
        reward=1.0,
        policy_version=None,
    )
    state = {
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "history": {"p": [0.5, float("nan"), np.float64(0.25)]},
        "counts": Counter(a=2),
        "streak": defaultdict(int, b=1),
        "bus": {"queued": {"strategy": [delivery]}, "seen": {"a": [3, [5, 6]]}},
        "buffer": {"pid": [(delivery, 3, {"b": 1})]},  # SGT's entries
        "failed": {"a": {"x", "y"}},
        "rows": {3: {"p": {"k": np.int64(4)}}},  # int keys
        "prefetched": {"p": (4, [sample], 0.5)},
        "pace": {"queued": {"b": [PacedRecord("a", 3, [delivery])]}},
        "tensors": [
            torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            torch.empty(0, 2),
            torch.tensor(True),
        ],
        "array": np.arange(4, dtype=np.uint32),
        "record": rollout("q"),
    }
    back = decode(encode(state, "run"), "run")
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == state["rng"]["python"]
    np_state = back["rng"]["numpy"]
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], state["rng"]["numpy"][1])
    assert np_state[2:] == state["rng"]["numpy"][2:]
    np.random.set_state(np_state)
    random.setstate(back["rng"]["python"])
    assert np.isnan(back["history"]["p"][1]) and type(back["history"]["p"][2]) is np.float64
    assert back["counts"] == {"a": 2} and back["streak"] == {"b": 1}
    for key in ("bus", "buffer", "failed", "rows", "prefetched", "pace", "record"):
        assert back[key] == state[key], key
    assert type(back["rows"][3]["p"]["k"]) is np.int64
    for got, want in zip(back["tensors"], state["tensors"]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert back["array"].dtype == np.uint32 and np.array_equal(back["array"], state["array"])


def test_the_extension_codes_are_the_file_format():
    """Hand-written bytes (not this encoder's) decode: the codes below are a format, frozen."""
    ext = msgspec.msgpack.Ext
    enc = msgspec.msgpack.encode
    data = enc(
        {
            "format": 2,
            "what": "strategy",
            "state": {
                "t": ext(1, enc([1, "x"])),
                "s": ext(2, enc([2, 1])),
                "g": ext(3, enc(["uint8", [3], bytes([1, 2, 3])])),
                "a": ext(4, enc(["<i2", [2], np.array([5, 6], "<i2").tobytes()])),
                "n": ext(5, enc(["<f8", np.float64(1.5).tobytes()])),
                "r": ext(
                    7,
                    enc(
                        state_codec.RecordCodec().envelope(
                            rollout(), kind="rollout", producer="", version=0, seq=0
                        )
                    ),
                ),
                "p": ext(8, enc(["prompt", {"text": "t", "answer": "a", "family": "f"}])),
            },
        }
    )
    got = decode(data, "strategy")
    assert (
        got["t"] == (1, "x")
        and got["s"] == {1, 2}
        and torch.equal(got["g"], torch.tensor([1, 2, 3], dtype=torch.uint8))
    )
    assert got["a"].tolist() == [5, 6] and got["n"] == 1.5 and got["r"] == rollout()
    assert got["p"] == Prompt(text="t", answer="a", family="f")


@pytest.mark.parametrize(
    "data, says",
    [
        (b"", "not a state file"),
        (encode({}, "strategy"), "expected 'run' state"),
        (msgspec.msgpack.encode({"format": 1, "what": "run", "state": {}}), "of format 2"),
        (
            msgspec.msgpack.encode(
                {
                    "format": 2,
                    "what": "run",
                    "state": msgspec.msgpack.Ext(4, msgspec.msgpack.encode(["|O", [1], b"x" * 8])),
                }
            ),
            "without objects",
        ),
        (
            msgspec.msgpack.encode(
                {"format": 2, "what": "run", "state": msgspec.msgpack.Ext(99, b"")}
            ),
            "unknown extension type 99",
        ),
    ],
)
def test_anything_else_is_a_decode_error_in_one_line(data, says):
    with pytest.raises(StateDecodeError, match=says) as caught:
        decode(data, "run", "RUN_DIR/x")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("RUN_DIR/x")


def test_a_value_a_checkpoint_cannot_hold_is_refused_where_it_sits():
    class Opaque:
        pass

    with pytest.raises(StateEncodeError, match=r"^strategy\.buf\[1\]: a .*Opaque cannot be kept"):
        encode({"buf": [1, Opaque()]}, "strategy")
    with pytest.raises(StateEncodeError, match=r"key \(1, 2\)"):
        encode({(1, 2): 0}, "strategy")
