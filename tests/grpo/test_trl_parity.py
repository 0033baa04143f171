"""Our GRPO update against TRL's own ``GRPOTrainer``, on identical inputs.

Each case builds one tiny random Llama, one batch (3 prompts of different lengths, left-padded;
4 completions each of different lengths, some ending in EOS, some truncated; rewards with a
constant group) and runs both sides:

* TRL: ``GRPOTrainer._generate_and_score_completions`` builds the inputs its own way (padding,
  completion and truncation masks, ``num_items_in_batch``, old and reference log-probs, rewards
  and advantages, the vLLM importance ratio); only generation is replaced, through TRL's
  ``rollout_func``, by the fixed completions. ``_compute_loss`` on each of its
  ``gradient_accumulation_steps`` micro-batches, then backward.
* ours: ``Learner.train_step`` on ``TrainSequence``s of the same token ids, our advantages
  (``grpo.advantage_std = "sample"``) and our own old log-probs; the loss and the gradient of
  each optimizer step are recorded before the step is taken.

Both sides get the same weights: the current ones, the older ones the old log-probs come from
(a policy that moved between generation and update, the off-policy part of the clipped
objective) and the reference (beta > 0). For a second iteration TRL's model takes the weights
our first optimizer step produced. Every case must agree on the advantages, the loss and every
parameter's gradient within ``RTOL``; the listed departures (docs/trl-parity.md) are checked to
differ. TRL is in the ``dev`` extra; without it the module is skipped.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig as TRLConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig  # noqa: E402
from mutualrl.grpo import group_advantages  # noqa: E402
from mutualrl.policies.batch import TrainBatch, TrainSequence, collate_sequences  # noqa: E402
from mutualrl.policies.learner import Learner  # noqa: E402
from mutualrl.policies.models import TokenizerFacts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL = 1e-4  # loss and gradients, relative (gradients: to their max |value|)
G, K, T, V = 4, 3, 5, 96  # group size, prompts, max_completion_length, vocabulary
BOS, EOS = 1, 2  # the mistral-v1 tokenizer's; its pad is EOS as well
REWARDS = [
    1.0,
    0.0,
    0.5,
    0.25,  # a varied group
    1.0,
    1.0,
    1.0,
    1.0,  # a constant group: advantages 0
    0.0,
    1.0,
    1.0,
    0.0,
]
# Settings both configs have under the same name (the rest are one side's own).
SHARED = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "num_iterations",
    "mask_truncated_completions",
    "importance_sampling_level",
    "use_bias_correction_kl",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
)


@dataclass(frozen=True)
class Case:
    name: str
    grpo: dict = field(default_factory=dict)  # shared names, or ours (advantage_std, ...)
    training: dict = field(default_factory=dict)  # our [training] (micro-batches, chunked head)
    stale: bool = True  # old log-probs from older weights; False: on-policy (TRL keeps none)
    vllm: bool = False  # sampler log-probs off the trainer's: the importance-ratio correction
    micro_batches: int = 1  # TRL's gradient_accumulation_steps (= steps_per_generation)


VLLM = dict(vllm_importance_sampling_sequence_ratio="sum")  # TRL's sequence ratio
CASES = [
    Case("grpo"),
    Case("dr_grpo", dict(loss_type="dr_grpo")),
    Case("dapo", dict(loss_type="dapo")),
    # dr_grpo divides by the run's completion budget, not by the batch's longest completion
    Case("dr_grpo-budget-8", dict(loss_type="dr_grpo", max_completion_length=8)),
    Case("on-policy", stale=False),
    Case("kl-bias-corrected", dict(beta=0.04, loss_type="dapo")),
    Case("kl-plain", dict(beta=0.04, use_bias_correction_kl=False)),
    Case("kl-sequence-level", dict(beta=0.04, importance_sampling_level="sequence")),
    Case("gspo", dict(importance_sampling_level="sequence", loss_type="dapo")),
    Case("epsilon-high", dict(epsilon_high=0.28, loss_type="dapo")),
    Case("scale-batch", dict(scale_rewards="batch")),
    Case("scale-none", dict(scale_rewards="none")),
    Case("two-iterations", dict(num_iterations=2, beta=0.04, learning_rate=1e-2)),
    Case("mask-truncated", dict(mask_truncated_completions=True, loss_type="dapo")),
    Case("temperature", dict(temperature=0.7, beta=0.04)),
    Case("micro-batches-grpo", training=dict(per_device_train_batch_size=6), micro_batches=2),
    Case(
        "micro-batches-dapo",
        dict(loss_type="dapo", beta=0.04, mask_truncated_completions=True),
        dict(per_device_train_batch_size=6),
        micro_batches=2,
    ),
    Case("chunked-head", dict(loss_type="dr_grpo"), dict(logprob_chunk_size=7)),
    Case(
        "micro-batches-dr_grpo",
        dict(loss_type="dr_grpo", importance_sampling_level="sequence"),
        dict(per_device_train_batch_size=6),
        micro_batches=2,
    ),
    *[
        Case(
            f"vllm-{mode}",
            dict(
                vllm_importance_sampling_mode=mode,
                beta=0.04,
                vllm_importance_sampling_clip_max=2.0,
                **VLLM,
            ),
            stale=False,
            vllm=True,
        )
        for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    ],
    Case(
        "vllm-clip-min",
        dict(
            vllm_importance_sampling_mode="token_mask",
            loss_type="dapo",
            vllm_importance_sampling_clip_min=0.8,
            **VLLM,
        ),
        stale=False,
        vllm=True,
    ),
]


def batch_ids() -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (K) with BOS, lengths 3-5, and completions (K * G), lengths 1 to T: rows 2, 6, 10
    truncated (T tokens, no EOS), the others ending in EOS (row 11 at exactly T)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [[BOS] + torch.randint(3, V, (2 + k,), generator=gen).tolist() for k in range(K)]
    completions = []
    for i in range(K * G):
        n = T if i % 4 == 2 or i == 11 else 1 + i % (T - 1)
        ids = torch.randint(3, V, (n,), generator=gen).tolist()
        completions.append(ids if i % 4 == 2 else ids[:-1] + [EOS])
    return prompts, completions


def perturbed(model, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """``model``'s weights plus seeded Gaussian noise: weights far enough apart that ratios leave
    the clip range and the KL to the reference is not negligible."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }


def our_settings(case: Case) -> tuple[GRPOConfig, TrainingConfig]:
    grpo = GRPOConfig(
        num_generations=G,
        prompts_per_step=K,
        **{"max_completion_length": T, "advantage_std": "sample", **case.grpo},
    )
    return grpo, TrainingConfig(max_grad_norm=0.0, weight_decay=0.0, **case.training)


def perturb(model, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """Add seeded Gaussian noise to ``model``'s parameters in place (tied ones once); its state
    after. Far enough from the reference and from each other that ratios leave the clip range
    and the KL is not negligible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Inputs:
    """One case's batch and weights, shared by both sides."""

    learner: Learner
    now: dict  # the weights the update starts from
    old: dict  # the weights the old log-probs come from
    prompts: list[list[int]]
    completions: list[list[int]]
    old_logprobs: list[list[float]]  # ours, under ``old``
    sampler_logprobs: list[list[float]]  # a vLLM sampler's: ours under ``now``, shifted


def row_logprobs(learner: Learner, prompts, completions) -> list[list[float]]:
    c = collate_sequences(
        tuple(TrainSequence(tuple(p), tuple(x), 0.0) for p, x in zip(prompts, completions)), EOS
    )
    lp = learner.logprobs.batch_logprobs(learner.model, c).cpu()
    return [lp[i, : len(x)].tolist() for i, x in enumerate(completions)]


def make_inputs(case: Case, tmp_path) -> Inputs:
    grpo, training = our_settings(case)
    cfg = PolicyConfig(name="p", architecture="llama", hidden_size=16, num_layers=1, num_heads=2)
    learner = Learner(cfg, grpo, TokenizerFacts(V, BOS, EOS, EOS), seed=0, training=training)
    learner.model.save_pretrained(tmp_path / "reference")  # TRL loads its reference from here
    prompts, comps = batch_ids()
    k_prompts = [prompts[i // G] for i in range(K * G)]
    old = perturb(learner.model, seed=1, scale=0.3)
    old_logprobs = row_logprobs(learner, k_prompts, comps)
    now = perturb(learner.model, seed=2, scale=0.1) if case.stale else old
    old_logprobs = old_logprobs if case.stale else row_logprobs(learner, k_prompts, comps)
    gen = torch.Generator().manual_seed(3)
    sampler = [
        [x - 0.6 * float(torch.randn((), generator=gen)) for x in row] for row in old_logprobs
    ]
    return Inputs(learner, now, old, k_prompts, comps, old_logprobs, sampler)


# ---- TRL's side -------------------------------------------------------------------------------
def trl_trainer(case: Case, x: Inputs, tokenizer, tmp_path) -> GRPOTrainer:
    grpo = x.learner.grpo
    shared = {name: getattr(grpo, name) for name in SHARED}
    # TRL keeps generation-time log-probs as old_per_token_logps only when the policy moves before
    # the update (here: more than one iteration per generation); else it uses the current ones.
    shared["num_iterations"] = max(grpo.num_iterations, 2 if case.stale else 1)
    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to="none",
        bf16=False,
        activation_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        per_device_train_batch_size=K * G // case.micro_batches,
        gradient_accumulation_steps=case.micro_batches,
        **shared,
    )
    model = copy.deepcopy(x.learner.model)
    model.load_state_dict(x.old)  # the weights that "generated"
    model.config._name_or_path = str(tmp_path / "reference")

    def rollout(prompts, trainer):  # TRL's generation hook: our fixed completions
        return {
            "prompt_ids": x.prompts,
            "completion_ids": x.completions,
            "logprobs": x.sampler_logprobs,
        }

    def reward(prompts, completions, completion_ids, **kwargs):
        return REWARDS[: len(prompts)]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * (K * G)}),
        rollout_func=rollout,
    )
    if case.vllm:  # as with a vLLM engine: the sampler's log-probs are not the trainer's
        trainer.use_vllm, trainer._last_loaded_step = True, trainer.state.global_step
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = case.micro_batches
    return trainer


def trl_step(trainer: GRPOTrainer, inputs: dict, weights: dict, micro_batches: int):
    """TRL's loss and gradients at ``weights``: ``_compute_loss`` per accumulation step."""
    model = trainer.model
    model.load_state_dict(weights)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for part in split_tensor_dict(inputs, micro_batches):
        mb_loss = trainer._compute_loss(model, part)
        mb_loss.backward()
        loss += float(mb_loss.detach())
    return loss, [p.grad.detach().clone() for p in model.parameters()]


# ---- our side ---------------------------------------------------------------------------------
def our_update(case: Case, x: Inputs):
    """Our advantages, the stats of ``train_step``, and per optimizer step its gradients and the
    weights they were taken at."""
    grpo, learner = x.learner.grpo, x.learner
    groups = torch.arange(K).repeat_interleave(G)
    adv = group_advantages(
        torch.tensor(REWARDS), groups, K, scale=grpo.scale_rewards, advantage_std=grpo.advantage_std
    ).advantages
    old = x.sampler_logprobs if case.vllm else x.old_logprobs
    seqs = tuple(
        TrainSequence(tuple(p), tuple(c), float(a), old_logprobs=tuple(o), truncated=c[-1] != EOS)
        for p, c, a, o in zip(x.prompts, x.completions, adv, old)
    )
    steps, real_step = [], learner.optimizer.step

    def recording_step(*args, **kwargs):
        steps.append(
            (
                [p.grad.detach().clone() for p in learner.model.parameters()],
                {k: v.detach().clone() for k, v in learner.model.state_dict().items()},
            )
        )
        return real_step(*args, **kwargs)

    learner.optimizer.step = recording_step
    learner.model.load_state_dict(x.now)
    stats = learner.train_step(TrainBatch(sequences=seqs), correct_mismatch=case.vllm)
    return adv, stats, steps


def run_both(case: Case, tokenizer, tmp_path, monkeypatch):
    """(our advantages, TRL's), (our loss, TRL's) of the last iteration, and per iteration the
    pair of gradient lists."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is "experimental"
    x = make_inputs(case, tmp_path)
    trainer = trl_trainer(case, x, tokenizer, tmp_path)
    inputs = trainer._generate_and_score_completions(
        [{"prompt": f"p{i // G}"} for i in range(K * G)]
    )
    adv, stats, steps = our_update(case, x)
    grads = []
    for ours, weights in steps:
        loss, theirs = trl_step(trainer, inputs, weights, case.micro_batches)
        grads.append((ours, theirs))
    return (adv, inputs["advantages"]), (stats, loss), grads, trainer


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (gradients of tiny entries are compared at the scale of
    the tensor, not entry by entry)."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_handles):
    return tokenizer_handles["mistral-v1"].tokenizer


# ---- the cases --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_our_update_equals_trls(case, tokenizer, tmp_path, monkeypatch):
    (adv, trl_adv), (stats, trl_loss), grads, trainer = run_both(
        case, tokenizer, tmp_path, monkeypatch
    )
    torch.testing.assert_close(adv, trl_adv, rtol=1e-5, atol=1e-6)
    # abs: an on-policy grpo loss is the mean advantage, 0 up to rounding
    assert stats["grpo_loss"] == pytest.approx(trl_loss, rel=RTOL, abs=1e-6)
    assert len(grads) == case.grpo.get("num_iterations", 1)
    for ours, theirs in grads:
        for a, b in zip(ours, theirs):
            assert max_rel(a, b) < RTOL
    # each case exercises what it is named after
    assert (stats["clip_ratio_low"] + stats["clip_ratio_high"] > 0) == case.stale
    assert (stats["kl"] > 0) == (case.grpo.get("beta", 0) > 0)
    assert (stats.get("mismatch/is_capped_frac", 0) > 0) == case.vllm
    assert ("mismatch/recompute_time_s" in stats) == case.vllm  # the recompute, timed apart
    if case.grpo.get("importance_sampling_level", "token") == "token" and case.micro_batches == 1:
        metrics = trainer._metrics["train"]
        assert stats["clip_ratio_low"] == pytest.approx(
            metrics["clip_ratio/low_mean"][-1], abs=1e-6
        )
        assert stats["clip_ratio_high"] == pytest.approx(
            metrics["clip_ratio/high_mean"][-1], abs=1e-6
        )


# ---- departures (docs/trl-parity.md): our defaults where TRL does otherwise -------------------
DEPARTURES = [
    # population std (our default): every advantage of a varied group is sqrt(n / (n - 1)) x TRL's
    Case("advantage-std-population", dict(advantage_std="population")),
    # exp of the mean token log-ratio (our default) where TRL sums: other weights, other loss
    Case(
        "vllm-sequence-ratio-mean",
        dict(
            vllm_importance_sampling_mode="sequence_truncate",
            vllm_importance_sampling_sequence_ratio="mean",
        ),
        stale=False,
        vllm=True,
    ),
]


@pytest.mark.parametrize("case", DEPARTURES, ids=[c.name for c in DEPARTURES])
def test_our_documented_departures_differ_from_trl(case, tokenizer, tmp_path, monkeypatch):
    (adv, trl_adv), (stats, trl_loss), grads, _ = run_both(case, tokenizer, tmp_path, monkeypatch)
    if case.grpo.get("advantage_std") == "population":
        varied = trl_adv != 0
        torch.testing.assert_close(
            adv[varied] / trl_adv[varied],
            torch.full((int(varied.sum()),), math.sqrt(G / (G - 1))),
            rtol=1e-3,
            atol=0,
        )
    assert abs(stats["grpo_loss"] - trl_loss) > 100 * RTOL * abs(trl_loss)
    assert max(max_rel(a, b) for a, b in zip(*grads[0])) > 100 * RTOL


@pytest.mark.parametrize("optim", [None, "adamw_torch", "adamw_torch_fused"])
def test_our_optimizer_is_the_one_trls_trainer_builds(optim, tmp_path):
    """``training.optim``: TRL's default and, for each name, the optimizer class and ``fused``
    flag that transformers' Trainer (which GRPOTrainer is) builds from a GRPOConfig."""
    from transformers import Trainer

    from mutualrl.policies.update import make_optimizer

    extra = {} if optim is None else {"optim": optim}
    args = TRLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, **extra)
    ours = TrainingConfig() if optim is None else TrainingConfig(optim=optim)
    assert ours.optim == str(getattr(args.optim, "value", args.optim))
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    optimizer, _ = make_optimizer(
        torch.nn.Linear(2, 2), PolicyConfig(name="p"), GRPOConfig(), ours, None
    )
    assert type(optimizer) is cls
    assert optimizer.defaults["fused"] == kwargs.get("fused")
