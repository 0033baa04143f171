"""Policies of both architectures on real tokenizers: sampling, log-prob consistency, updates,
saving."""

from __future__ import annotations

import math

import pytest
import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import SFTExample, TrainBatch, TrainSequence, collate
from mutualrl.policies.policy import Policy
from mutualrl.tasks.base import Prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GRPO = GRPOConfig(
    num_generations=4,
    prompts_per_step=2,
    max_completion_length=4,
    temperature=0.7,
    learning_rate=1e-2,
)
ARCHS = [("llama", "mistral-v1"), ("qwen2", "deepseek-v3")]
PROMPTS = [
    Prompt(text="first: cat dog sun tree =", answer=" cat", family="first"),
    Prompt(text="last: red blue car =", answer=" car", family="last"),
]


def make_policy(handles, arch, tok, *, seed=0, grpo=GRPO, **kw) -> Policy:
    cfg = PolicyConfig(
        name=f"{arch}-test",
        architecture=arch,
        tokenizer=tok,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        **kw,
    )
    return Policy(cfg, grpo, seed=seed, handle=handles[tok])


@pytest.fixture(params=ARCHS, ids=[a for a, _ in ARCHS], scope="module")
def arch_tok(request):
    return request.param


@pytest.fixture
def policy(tokenizer_handles, arch_tok):
    return make_policy(tokenizer_handles, *arch_tok)


def params_of(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


def changed(before, policy) -> bool:
    return any(not torch.equal(a, b.detach()) for a, b in zip(before, policy.model.parameters()))


def sequences_from(samples, advantages):
    return tuple(
        TrainSequence(
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            advantage=a,
            old_logprobs=s.logprobs,
            truncated=s.finish_reason == "length",
        )
        for s, a in zip(samples, advantages)
    )


def test_builds_the_requested_architecture_on_its_tokenizer(policy, arch_tok, tokenizer_handles):
    arch, tok = arch_tok
    assert policy.model.config.model_type == arch
    assert policy.model.config.hidden_size == 32
    assert policy.handle is tokenizer_handles[tok]
    emb = policy.model.get_input_embeddings().weight
    assert emb.shape[0] == len(tokenizer_handles[tok].tokenizer)
    assert policy.learner.reference is None  # beta 0 builds no reference


def test_reference_only_with_beta(tokenizer_handles):
    grpo = GRPOConfig(num_generations=2, beta=0.1)
    p = make_policy(tokenizer_handles, "llama", "mistral-v1", grpo=grpo)
    assert p.learner.reference is not None
    assert all(not q.requires_grad for q in p.learner.reference.parameters())


def test_generate_shapes_logprobs_and_finish_reasons(policy):
    samples = policy.generate(PROMPTS, num_generations=3, max_new_tokens=4, temperature=1.0)
    assert len(samples) == 6
    assert [s.group for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.prompt for s in samples] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    eos = policy.tokenizer.eos_token_id
    for s in samples:
        assert s.prompt_ids == policy.encode_prompt(s.prompt.text)
        assert 1 <= len(s.completion_ids) <= 4
        assert len(s.logprobs) == len(s.completion_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs)
        if s.finish_reason == "stop":
            assert s.completion_ids[-1] == eos and eos not in s.completion_ids[:-1]
        else:
            assert s.finish_reason == "length"
            assert len(s.completion_ids) == 4 and eos not in s.completion_ids
        assert s.text == policy.tokenizer.decode(s.completion_ids, skip_special_tokens=True)


@pytest.fixture
def eos_on_second_token_of_row0(policy):
    """Force row 0 to sample EOS as its 2nd token (a hook on the LM head, 2nd forward only)."""
    calls = []

    def hook(module, inputs, output):
        calls.append(None)
        if len(calls) == 2:
            output = output.clone()
            output[0, -1, policy.tokenizer.eos_token_id] += 1e4
        return output

    handle = policy.model.get_output_embeddings().register_forward_hook(hook)
    yield policy
    handle.remove()


def test_generate_stops_rows_at_eos_and_pads_after(eos_on_second_token_of_row0):
    policy = eos_on_second_token_of_row0
    eos = policy.tokenizer.eos_token_id
    samples = policy.generate(PROMPTS, 2, 4, temperature=1.0)
    first = samples[0]
    assert first.finish_reason == "stop"
    assert len(first.completion_ids) == 2 and first.completion_ids[1] == eos
    assert len(first.logprobs) == 2 and first.logprobs[1] == pytest.approx(0.0, abs=1e-3)
    assert first.text == policy.tokenizer.decode(first.completion_ids[:1], skip_special_tokens=True)
    others = samples[1:]
    assert all(s.finish_reason == "length" and len(s.completion_ids) == 4 for s in others)


def test_generate_stops_early_when_every_row_ends(policy):
    eos = policy.tokenizer.eos_token_id
    calls = []

    def hook(module, inputs, output):
        calls.append(None)
        output = output.clone()
        output[..., eos] += 1e4
        return output

    handle = policy.model.get_output_embeddings().register_forward_hook(hook)
    try:
        samples = policy.generate(PROMPTS, 3, 4, temperature=1.0)
    finally:
        handle.remove()
    assert len(calls) == 1  # the prompt forward only: every row stopped at its first token
    assert all(
        s.completion_ids == (eos,) and s.finish_reason == "stop" and s.text == "" for s in samples
    )


def test_behaviour_logprobs_match_the_training_forward(policy):
    """The ratio-1 invariant: what generate recorded is what the loss recomputes."""
    samples = policy.generate(PROMPTS, 4, 4, temperature=GRPO.temperature)
    c = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], policy.pad_id)
    policy.model.eval()
    with torch.no_grad():
        logp = selective_log_softmax(
            policy.learner.logprobs.completion_logits(policy.model, c), c.completion_ids
        )
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        torch.testing.assert_close(logp[i, :n], torch.tensor(s.logprobs), atol=1e-4, rtol=0)
    # sequence_logprobs gives their sums
    totals = policy.sequence_logprobs(
        [s.prompt_ids for s in samples], [s.completion_ids for s in samples]
    )
    torch.testing.assert_close(
        totals, torch.tensor([sum(s.logprobs) for s in samples]), atol=1e-4, rtol=0
    )


def test_greedy_generation_takes_the_argmax(policy):
    samples = policy.generate(PROMPTS[:1], 2, 3, temperature=0.0)
    assert samples[0].completion_ids == samples[1].completion_ids
    c = collate([samples[0].prompt_ids], [samples[0].completion_ids], policy.pad_id)
    policy.model.eval()
    with torch.no_grad():
        logits = policy.learner.logprobs.completion_logits(policy.model, c)[0]
    assert logits.argmax(-1).tolist() == list(samples[0].completion_ids)


def test_same_seed_same_samples(tokenizer_handles, arch_tok):
    a = make_policy(tokenizer_handles, *arch_tok, seed=5)
    b = make_policy(tokenizer_handles, *arch_tok, seed=5)
    sa = a.generate(PROMPTS, 4, 4, 1.0)
    sb = b.generate(PROMPTS, 4, 4, 1.0)
    assert [(s.completion_ids, s.logprobs) for s in sa] == [
        (s.completion_ids, s.logprobs) for s in sb
    ]
    again = a.generate(PROMPTS, 4, 4, 1.0)  # the policy's generator moved on
    assert [s.completion_ids for s in again] != [s.completion_ids for s in sa]


def test_different_seeds_differ(tokenizer_handles):
    a = make_policy(tokenizer_handles, "llama", "mistral-v1", seed=5)
    c = make_policy(tokenizer_handles, "llama", "mistral-v1", seed=6)
    assert not torch.equal(
        a.model.get_input_embeddings().weight, c.model.get_input_embeddings().weight
    )
    assert [s.completion_ids for s in a.generate(PROMPTS, 4, 4, 1.0)] != [
        s.completion_ids for s in c.generate(PROMPTS, 4, 4, 1.0)
    ]


def test_train_step_changes_parameters_with_signal(policy):
    samples = policy.generate(PROMPTS, 4, 4, GRPO.temperature)
    adv = [1.0, -1.0] * 4
    before = params_of(policy)
    stats = policy.train_step(TrainBatch(sequences=sequences_from(samples, adv)))
    assert changed(before, policy)
    assert stats["skipped_nan"] == 0.0 and stats["grad_norm"] > 0
    # first pass is on-policy: ratio 1, nothing clipped, loss = -mean advantage (0 here)
    assert stats["clip_ratio_low"] == 0.0 and stats["clip_ratio_high"] == 0.0
    assert stats["kl"] == 0.0
    assert stats["grpo_loss"] == pytest.approx(0.0, abs=1e-5)
    assert stats["entropy"] > 0
    assert policy.version == 1


def test_zero_advantages_give_zero_gradient_and_only_weight_decay(tokenizer_handles):
    p = make_policy(tokenizer_handles, "llama", "mistral-v1")
    samples = p.generate(PROMPTS, 4, 4, GRPO.temperature)
    before = params_of(p)
    stats = p.train_step(TrainBatch(sequences=sequences_from(samples, [0.0] * 8)))
    assert stats["grad_norm"] == 0.0
    assert stats["grpo_loss"] == 0.0
    # AdamW with a zero gradient moves nothing but its decoupled weight decay: p <- p (1 - lr wd)
    group = p.learner.optimizer.param_groups[0]
    shrink = 1 - group["lr"] * group["weight_decay"]
    for b, a in zip(before, p.model.parameters()):
        torch.testing.assert_close(a.detach(), b * shrink, atol=0, rtol=1e-6)


def test_nan_loss_is_skipped_and_counted(tokenizer_handles, monkeypatch):
    policy = make_policy(tokenizer_handles, "llama", "mistral-v1")
    samples = policy.generate(PROMPTS, 4, 4, GRPO.temperature)
    before = params_of(policy)
    state_before = len(policy.learner.optimizer.state)
    real = policy.learner.logprobs.completion_logits
    monkeypatch.setattr(
        policy.learner.logprobs,
        "completion_logits",
        lambda model, c, **kw: real(model, c, **kw) * float("nan"),
    )
    stats = policy.train_steps([TrainBatch(sequences=sequences_from(samples, [1.0, -1.0] * 4))])
    assert stats["skipped_nan"] == 1.0
    assert stats["skipped_nan_total"] == 1
    assert policy.learner.skipped_nan_steps == 1
    assert not changed(before, policy)
    assert len(policy.learner.optimizer.state) == state_before  # the optimizer never stepped


def test_sft_step_lowers_the_loss_on_a_repeated_batch(policy):
    examples = tuple(
        SFTExample(policy.encode_prompt(p.text), policy.encode_completion(p.answer))
        for p in PROMPTS
    )
    with torch.no_grad():
        start = float(policy.learner.objective.sft_total_loss(policy.model, examples))
    for _ in range(3):
        policy.sft_step(examples, learning_rate=3e-2)
    with torch.no_grad():
        end = float(policy.learner.objective.sft_total_loss(policy.model, examples))
    assert end < start - 0.1, (start, end)
    # the override applied to those steps only
    assert policy.learner.optimizer.param_groups[0]["lr"] == GRPO.learning_rate


def test_a_batch_learning_rate_applies_to_that_update_only(policy, monkeypatch):
    examples = tuple(
        SFTExample(policy.encode_prompt(p.text), policy.encode_completion(p.answer))
        for p in PROMPTS
    )
    seen: list[float] = []
    step = policy.learner.optimizer.step
    monkeypatch.setattr(
        policy.learner.optimizer,
        "step",
        lambda *a, **k: (
            seen.append(policy.learner.optimizer.param_groups[0]["lr"]),
            step(*a, **k),
        )[1],
    )
    policy.train_steps(
        [
            TrainBatch(sft=examples, sft_coef=1.0, tag="sft", learning_rate=3e-2),
            TrainBatch(sft=examples, sft_coef=1.0, tag="sft"),
        ]
    )
    assert seen == [3e-2, GRPO.learning_rate]
    assert policy.learner.optimizer.param_groups[0]["lr"] == GRPO.learning_rate


def test_encode_completion_appends_eos(policy):
    ids = policy.encode_completion(" cat")
    assert ids[-1] == policy.tokenizer.eos_token_id
    assert policy.encode_completion(" cat", eos=False) == ids[:-1]
    assert policy.tokenizer.decode(ids[:-1]).strip() == "cat"


def test_save_reloads_with_identical_logits(policy, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = policy.save(tmp_path)
    assert path == tmp_path / policy.name
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    text = PROMPTS[0].text
    assert (
        tok(text, add_special_tokens=False)["input_ids"]
        == policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    )
    ids = torch.tensor([policy.encode_prompt(text)])
    policy.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, policy.model(input_ids=ids).logits)


@pytest.mark.parametrize("lora", [False, True], ids=["copy", "lora"])
def test_kl_to_the_reference_starts_at_zero_and_grows(tokenizer_handles, lora):
    from mutualrl.config import LoraConfig

    grpo = GRPOConfig(
        num_generations=4, max_completion_length=4, temperature=0.7, beta=0.1, learning_rate=5e-2
    )
    p = make_policy(
        tokenizer_handles,
        "llama",
        "mistral-v1",
        grpo=grpo,
        lora=LoraConfig(r=4, alpha=8) if lora else None,
    )
    assert (
        p.learner.reference is None
    ) == lora  # a LoRA policy's reference is its adapter disabled
    samples = p.generate(PROMPTS, 4, 4, grpo.temperature)
    batch = TrainBatch(sequences=sequences_from(samples, [1.0, -1.0] * 4))
    first = p.train_step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    second = p.train_step(batch)
    assert second["kl"] > 1e-6


def test_saved_lora_policy_without_checkpoint_is_reloadable(tokenizer_handles, tmp_path):
    from transformers import AutoModelForCausalLM

    from mutualrl.config import LoraConfig

    p = make_policy(tokenizer_handles, "llama", "mistral-v1", lora=LoraConfig(r=4, alpha=8))
    path = p.save(tmp_path)
    # a full model folder, not an adapter pointing at a base model that exists nowhere
    assert (path / "config.json").is_file(), sorted(x.name for x in path.iterdir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([p.encode_prompt(PROMPTS[0].text)])
    p.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, p.model(input_ids=ids).logits)


def test_a_batch_with_nothing_to_learn_is_a_no_op(tokenizer_handles):
    p = make_policy(tokenizer_handles, "llama", "mistral-v1")
    examples = (SFTExample(p.encode_prompt(PROMPTS[0].text), p.encode_completion(" cat")),)
    before = params_of(p)
    p.train_step(TrainBatch(sft=examples, sft_coef=0.0))
    assert not changed(before, p)


def test_a_loaded_state_continues_exactly_where_the_saved_policy_stands(
    tokenizer_handles, tmp_path
):
    """Weights, optimizer moments and the sampler's generator travel: the copy samples the same
    completions and takes the same update as the original, bit for bit."""
    a = make_policy(tokenizer_handles, "qwen2", "deepseek-v3", seed=1)
    examples = (SFTExample(a.encode_prompt(PROMPTS[0].text), a.encode_completion(" cat")),)
    a.sft_step(examples)
    a.generate(PROMPTS, 2, 4, 0.7)  # advance the generator away from its seed
    a.save_state(tmp_path / "a.pt")
    b = make_policy(tokenizer_handles, "qwen2", "deepseek-v3", seed=7)
    b.load_state(tmp_path / "a.pt")
    assert (
        b.learner.optimizer.state_dict()["state"].keys()
        == a.learner.optimizer.state_dict()["state"].keys()
    )
    sa, sb = (p.generate(PROMPTS, 4, 4, 0.7) for p in (a, b))
    assert [(s.completion_ids, s.logprobs) for s in sa] == [
        (s.completion_ids, s.logprobs) for s in sb
    ]
    batch = TrainBatch(sequences=sequences_from(sa, [1.0, -1.0] * 4))
    assert a.train_step(batch)["loss"] == b.train_step(batch)["loss"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_loading_another_policys_state_is_refused(tokenizer_handles, tmp_path):
    a = make_policy(tokenizer_handles, "llama", "mistral-v1")
    a.save_state(tmp_path / "a.pt")
    other = Policy(
        PolicyConfig(
            name="someone-else",
            architecture="llama",
            tokenizer="mistral-v1",
            hidden_size=32,
            num_layers=1,
            num_heads=4,
        ),
        GRPO,
        seed=0,
        handle=tokenizer_handles["mistral-v1"],
    )
    with pytest.raises(ValueError, match="llama-test.*not 'someone-else'"):
        other.load_state(tmp_path / "a.pt")


def test_freeze_reference_makes_the_current_weights_the_kl_reference(tokenizer_handles):
    grpo = GRPOConfig(
        num_generations=4, max_completion_length=4, temperature=0.7, beta=0.1, learning_rate=5e-2
    )
    p = make_policy(tokenizer_handles, "llama", "mistral-v1", grpo=grpo)
    p.sft_step(
        (SFTExample(p.encode_prompt(PROMPTS[0].text), p.encode_completion(" cat")),),
        learning_rate=5e-2,
    )
    batch = TrainBatch(sequences=sequences_from(p.generate(PROMPTS, 4, 4, 0.7), [1.0, -1.0] * 4))
    assert p.train_step(batch)["kl"] > 1e-6  # measured against the initial weights
    p.freeze_reference()
    assert p.train_step(batch)["kl"] == 0.0  # measured against the weights just frozen


def test_saving_draws_no_progress_bar_and_keeps_the_setting(policy, tmp_path, capfd):
    """``Policy.save`` goes through ``save_pretrained_quietly``: transformers draws no bar in any
    process (with bars on, as in a spawned worker), and the caller's setting is left as it was."""
    from transformers.utils import logging as hf_logging

    from mutualrl.policies.checkpoints import save_pretrained_quietly

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        policy.save(tmp_path)
        assert "Writing model shards" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        save_pretrained_quietly(policy.model, tmp_path / "again")
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def test_concurrent_saves_keep_the_bars_off_until_the_last_ends(tmp_path):
    """The threaded executor saves policies at once: the first save ending must not turn the bars
    back on under a second one still writing."""
    import threading

    from transformers.utils import logging as hf_logging

    from mutualrl.policies.checkpoints import save_pretrained_quietly

    first_started, second_started, first_done = (threading.Event() for _ in range(3))
    seen = []

    class First:  # starts first, ends while the second is still writing
        def save_pretrained(self, path):
            first_started.set()
            assert second_started.wait(10)

    class Second:
        def save_pretrained(self, path):
            second_started.set()
            assert first_done.wait(10)
            seen.append(hf_logging.is_progress_bar_enabled())

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        first = threading.Thread(
            target=lambda: (save_pretrained_quietly(First(), tmp_path / "a"), first_done.set())
        )
        first.start()
        assert first_started.wait(10)
        save_pretrained_quietly(Second(), tmp_path / "b")
        first.join(10)
        assert seen == [False]
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
