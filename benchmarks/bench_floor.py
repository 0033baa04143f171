"""One mutualrl GRPO step against bare PyTorch doing the same work: how far from the floor we are.

The mutualrl side is a real run (``run.build_run`` of a one-policy config, strategy ``none``, no
warm start, no evaluation) stepped with ``run.schedule.lock_step``: generate through the executor,
verify, publish to the exchange, the strategy's batches, the update, the log record. Its phase
times come from the run's own ``phase/*_time_s``.

The bare side is the least code that computes the same thing, written from scratch in this file:
a KV-cache decode loop (``logits_to_keep=1`` prefill, one forward per drawn token, none after the
last) with inverse-CDF sampling, a reward (``reward`` below, on both sides), group-normalised
advantages, one
forward/backward with the LM head on the completion positions only, the clipped GRPO loss
(``loss_type = "grpo"``, ratio 1 on the single pass), ``clip_grad_norm_`` and AdamW. It starts
from the policy's weights, optimizer state and sampler generator, copied again before every step
(untimed), so both sides draw the same tokens from the same state, and their losses and gradient
norms are compared every step (reported; they agree to float rounding).

The bare side has the run's two levers, each on its own switch (``Bare(..., bf16=, shared=)``,
used by ``bench_real_step.py``): bf16 autocast over fp32 weights, and each prompt computed once
(prefilled once and its cache repeated, ``batch_repeat_interleave``, in the sampler; in the
update, one micro-batch per group whose prompt runs on one row, its cache repeated for the
group's completions). With both on it is the least work that computes the step, so "at the
floor" means at the least work; off, it is the plain loop this file has always timed.

The two alternate step by step in one process with the same thread count, so both see the same
machine. Medians per phase and their ratios go to JSON.

    python benchmarks/bench_floor.py --json floor_32k.json --steps 24
    python benchmarks/bench_floor.py --tokenizer deepseek-v3 --json floor_129k.json --steps 24

``benchmarks/results/floor.json`` holds the newest run of each ``--tokenizer`` and
``--checkpoint``, each with its command; a run replaces only its own.

    python benchmarks/bench_floor.py --checkpoint smollm2-135m-instruct --chat-template \\
        --prompts 2 --generations 8 --tokens 64 --steps 6 --json benchmarks/results/floor.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

from mutualrl.bench.results import write_run
from mutualrl.config import load_config
from mutualrl.grpo.advantages import EPS
from mutualrl.malloc import reuse_large_buffers
from mutualrl.policies.batch import collate
from mutualrl.policies.generation.torch import cache_keyword
from mutualrl.policies.model_cache import resolve_checkpoint
from mutualrl.policies.sampling import sample_tokens
from mutualrl.policies.update import adamw_fused
from mutualrl.provenance import git_commit, machine_info
from mutualrl.run.build import build_run
from mutualrl.run.phases import sample_prompts
from mutualrl.run.schedule import lock_step

ROOT = Path(__file__).resolve().parent.parent
ARCH = {"mistral-v1": "llama", "deepseek-v3": "qwen2"}


def config(a, out: Path):
    sets = [
        f'output_dir="{out}"',
        'strategy="none"',
        f"torch_threads={a.threads}",
        f"steps={a.steps + 1}",
        "save_steps=0",
        "warmup.max_steps=0",
        "eval.every=0",
        f"grpo.num_generations={a.generations}",
        f"grpo.prompts_per_step={a.prompts}",
        f"grpo.max_completion_length={a.tokens}",
        "grpo.temperature=1.0",
        "grpo.beta=0.0",
        'grpo.loss_type="grpo"',
    ]
    if a.checkpoint:
        # a pretrained checkpoint on the real-models task, its prompts as a run renders them
        # (SmolLM2 through its chat template); one micro-batch, as the bare side computes it
        chat = "true" if a.chat_template else "false"
        folder = resolve_checkpoint(a.checkpoint)
        sets += [
            'task.name="arithmetic"',
            'task.families=["add", "mul", "count"]',
            "task.digits={mul=1}",
            f"training.per_device_train_batch_size={a.prompts * a.generations}",
            f'policies=[{{name="p", checkpoint="{folder}", chat_template={chat}}}]',
        ]
    else:
        sets += [
            'task.name="lookup"',
            "task.families=[]",
            f'policies=[{{name="p", architecture="{ARCH[a.tokenizer]}", '
            f'tokenizer="{a.tokenizer}", hidden_size={a.hidden}, num_layers={a.layers}, '
            "num_heads=4}]",
        ]
    return load_config(ROOT / "configs" / "tiny.toml", sets)


def reward(prompt, text: str) -> float:
    """A cheap deterministic reward with spread in every group (a random policy scores 0 on the
    task, which would zero every advantage and make the loss comparison vacuous)."""
    return (sum(map(ord, text)) % 7) / 6


class _Verifier:
    """``reward`` in place of the run's verifier, keeping its error counters for the log."""

    def __init__(self, real) -> None:
        self.counters = real.counters

        self.close = real.close

    def __call__(self, prompt, text: str) -> float:
        return reward(prompt, text)

    def score_many(self, items) -> list[float]:
        return [reward(prompt, text) for prompt, text in items]


class Bare:
    """The same step in plain PyTorch, on copies of the policy's weights and generator."""

    def __init__(
        self, policy, cfg, bf16: bool = False, shared: bool = False, attn: str | None = None
    ) -> None:
        self.bf16, self.shared = bf16, shared  # the levers: bf16 autocast, each prompt once
        self.attn = attn  # the update's attention kernel (None: the model's, as in sampling)
        self.model = copy.deepcopy(policy.learner.model)
        self.generator = torch.Generator().set_state(policy.generator.get_state())
        self.tok, self.pad, self.g, self.t = policy.tokenizer, policy.pad_id, cfg.grpo, cfg.training
        self.encode = policy.encode_prompt
        self.cache = cache_keyword(self.model)
        group = policy.learner.optimizer.param_groups[0]
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            fused=adamw_fused(cfg.training.optim),  # the run's kernel
        )

    def sync_from(self, policy) -> None:
        """Take the policy's weights, optimizer state and generator (outside the timing), so
        each step is compared on the same inputs: otherwise float rounding of the weights flips
        a sampled token after some steps and the two runs drift apart."""
        self.model.load_state_dict(policy.learner.model.state_dict())
        self.opt.load_state_dict(policy.learner.optimizer.state_dict())
        for g in self.opt.param_groups:  # the loaded groups carry the policy's kernel flag
            g["fused"] = adamw_fused(self.t.optim)
        self.generator.set_state(policy.generator.get_state())

    def precision(self):
        """bf16 autocast where the bf16 lever is on (fp32 weights, as the run keeps them)."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    @torch.no_grad()
    def generate(self, prompt_ids):
        m, eos, n = self.model.eval(), self.tok.eos_token_id, self.g.num_generations
        ids = [p for p in prompt_ids for _ in range(n)]
        # the prompt-once lever: each prompt prefilled once, its cache repeated for its rows
        c = collate(prompt_ids if self.shared else ids, [()] * len(ids), self.pad)
        P = c.input_ids.shape[1] - 1
        attn, pos = c.attention_mask[:, :P], c.position_ids[:, :P]
        with self.precision():
            out = m(
                input_ids=c.input_ids[:, :P],
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
            )
            logits, cache = out.logits[:, -1], getattr(out, self.cache)
            if self.shared:
                cache.batch_repeat_interleave(n)
                logits = logits.repeat_interleave(n, 0)
                attn, pos = attn.repeat_interleave(n, 0), pos.repeat_interleave(n, 0)
            done = torch.zeros(len(ids), dtype=torch.bool)
            toks = []
            for i in range(self.g.max_completion_length):
                if i:
                    attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
                    pos = pos[:, -1:] + 1
                    out = m(
                        input_ids=toks[-1][:, None],
                        attention_mask=attn,
                        position_ids=pos,
                        use_cache=True,
                        **{self.cache: cache},
                    )
                    logits, cache = out.logits[:, -1], getattr(out, self.cache)
                tok = sample_tokens(torch.log_softmax(logits.float(), -1), self.generator)
                tok = torch.where(done, torch.full_like(tok, self.pad), tok)
                toks.append(tok)
                done |= tok == eos
                if bool(done.all()):
                    break
        rows = torch.stack(toks, 1).tolist()
        return ids, [tuple(r[: r.index(eos) + 1] if eos in r else r) for r in rows]

    def hidden(self, c):
        """(rows, T, H) final hidden states at the positions predicting the completion tokens;
        with the prompt-once lever (rows in whole groups of num_generations, one prompt each)
        each group's prompt runs on one row and its cache is repeated for the others."""
        decoder, L, T = self.model.model, c.input_ids.shape[1], c.completion_len
        if not self.shared:
            out = decoder(
                input_ids=c.input_ids, attention_mask=c.attention_mask, position_ids=c.position_ids
            )
            return out.last_hidden_state[:, L - T - 1 : L - 1]
        n, P = self.g.num_generations, L - T
        out = decoder(
            input_ids=c.input_ids[::n, :P],
            attention_mask=c.attention_mask[::n, :P],
            position_ids=c.position_ids[::n, :P],
            use_cache=True,
        )
        lead = out.last_hidden_state[:, -1:].repeat_interleave(n, 0)
        if T == 1:
            return lead
        cache = getattr(out, self.cache)
        cache.batch_repeat_interleave(n)
        tail = decoder(
            input_ids=c.input_ids[:, P : L - 1],
            attention_mask=c.attention_mask[:, : L - 1],
            position_ids=c.position_ids[:, P : L - 1],
            use_cache=True,
            **{self.cache: cache},
        ).last_hidden_state
        return torch.cat([lead, tail], 1)

    def token_loss(self, hidden, ids, lengths, adv):
        """Sum of the clipped per-token loss over rows (ratio 1 on the single pass)."""
        T = ids.shape[1]
        logits = self.model.lm_head(hidden).float()
        logits = logits / self.g.temperature if self.g.temperature != 1 else logits
        logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
        mask = (torch.arange(T)[None] < lengths[:, None]).float()
        ratio = torch.exp(logp - logp.detach())
        a, e = adv[:, None], self.g.epsilon
        per_token = -torch.min(ratio * a, ratio.clamp(1 - e, 1 + e) * a)
        if self.g.loss_type == "dapo":
            return (per_token * mask).sum()
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum()

    def update(self, ids, completions, rewards) -> tuple[float, float]:
        self.model.train()
        n = self.g.num_generations
        r = torch.tensor(rewards).view(-1, n)
        # the run's settings: scale_rewards "group", population std (grpo.advantage_std)
        r = r.double()
        std = r.std(1, keepdim=True, unbiased=self.g.advantage_std == "sample")
        adv = ((r - r.mean(1, keepdim=True)) / (std + EPS)).float().flatten()
        # the run's micro-batches (per_device_train_batch_size; None: all rows at once)
        per = self.t.per_device_train_batch_size or len(ids)
        assert not self.shared or per % n == 0, "the prompt-once lever takes whole groups"
        # dapo's normaliser: the batch's tokens; grpo's: its rows
        norm = sum(len(x) for x in completions) if self.g.loss_type == "dapo" else len(ids)
        total = 0.0
        for lo in range(0, len(ids), per):
            rows = slice(lo, lo + per)
            c = collate(ids[rows], completions[rows], self.pad)
            with self.precision():
                hidden = self.hidden(c)
                # the LM head over logprob_chunk_size positions at a time, recomputed in
                # backward (torch's checkpoint), where the run's config chunks it
                chunk = self.t.logprob_chunk_size
                step = len(c.completion_ids)
                if chunk is not None and hidden.shape[0] * hidden.shape[1] > chunk:
                    step = max(1, chunk // hidden.shape[1])
                loss = sum(
                    torch.utils.checkpoint.checkpoint(
                        self.token_loss,
                        hidden[i : i + step],
                        c.completion_ids[i : i + step],
                        c.lengths[i : i + step],
                        adv[rows][i : i + step],
                        use_reentrant=False,
                    )
                    if step < len(c.completion_ids)
                    else self.token_loss(hidden, c.completion_ids, c.lengths, adv[rows])
                    for i in range(0, len(c.completion_ids), step)
                ) / max(norm, 1)
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total, float(norm)

    def step(self, run, step: int) -> tuple[dict[str, float], tuple[float, float]]:
        t0 = time.perf_counter()
        prompts = sample_prompts(run, step)
        ids, completions = self.generate([self.encode(p.text) for p in prompts])
        t1 = time.perf_counter()
        groups = [p for p in prompts for _ in range(self.g.num_generations)]
        rewards = [
            reward(p, self.tok.decode(cp, skip_special_tokens=True))
            for p, cp in zip(groups, completions)
        ]
        t2 = time.perf_counter()
        kernel = self.model.config._attn_implementation
        if self.attn is not None:  # the update's kernel, the sampler's again after it
            self.model.set_attn_implementation(self.attn)
        try:
            got = self.update(ids, completions, rewards)
        finally:
            if self.attn is not None:
                self.model.set_attn_implementation(kernel)
        t3 = time.perf_counter()
        return {"generate": t1 - t0, "verify": t2 - t1, "update": t3 - t2, "step": t3 - t0}, got


def ours(run, step: int) -> tuple[dict[str, float], tuple[float, float]]:
    t0 = time.perf_counter()
    rec = lock_step(run, step)
    wall = time.perf_counter() - t0
    times = {k: rec.get(f"phase/{k}_time_s", 0.0) for k in ("generate", "verify", "update")}
    times["step"] = wall
    return times, (rec["policy/p/loss"], rec["policy/p/grad_norm"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--tokenizer", default="mistral-v1", choices=sorted(ARCH))
    ap.add_argument(
        "--checkpoint",
        help="a pretrained model instead of the random one: a packaged model's name "
        "(smollm2-135m-instruct, gemma-3-270m) or a from_pretrained folder",
    )
    ap.add_argument(
        "--chat-template",
        action="store_true",
        help="render the checkpoint's prompts with its chat template",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--malloc",
        choices=["reuse", "system"],
        default="reuse",
        help="the allocator set-up of both sides (malloc.py)",
    )
    a = ap.parse_args()
    os.environ["MUTUALRL_MALLOC"] = a.malloc
    malloc = reuse_large_buffers()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(a, Path(tmp) / "run")
        run = build_run(cfg)
        run.verifier = _Verifier(run.verifier)
        try:
            policy = run.executor.worker("p")
            bare = Bare(policy, cfg)
            times = {"mutualrl": [], "bare": []}
            agree = []
            for step in range(a.steps + 1):  # step 0 warms both up, then dropped
                order = [("mutualrl", ours), ("bare", bare.step)]
                got = {}
                bare.sync_from(policy)
                for name, fn in order if step % 2 == 0 else order[::-1]:
                    t, got[name] = fn(run, step)
                    if step:
                        times[name].append(t)
                agree.append([abs(x - y) for x, y in zip(got["mutualrl"], got["bare"])])
                if step:
                    print(
                        f"step {step}: mutualrl {times['mutualrl'][-1]['step']:.3f} s, bare "
                        f"{times['bare'][-1]['step']:.3f} s, |d loss| {agree[-1][0]:.1e}, "
                        f"|d grad norm| {agree[-1][1]:.1e}",
                        flush=True,
                    )
        finally:
            run.close()
    med = {n: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for n, ts in times.items()}
    ratio = {k: med["mutualrl"][k] / med["bare"][k] for k in med["bare"] if med["bare"][k] > 0}
    record = {
        "benchmark": "floor",
        "label": a.checkpoint or a.tokenizer,  # the run it replaces in floor.json
        "command": "python benchmarks/bench_floor.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(),
        "machine": machine_info(torch=torch.__version__),
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "malloc": malloc,
        "median_s": med,
        "ratio_mutualrl_over_bare": ratio,
        "max_abs_diff": {"loss": max(d[0] for d in agree), "grad_norm": max(d[1] for d in agree)},
        "per_step_s": times,
    }
    write_run(a.json, record)
    print(
        json.dumps(
            {"median_s": med, "ratio": ratio, "max_abs_diff": record["max_abs_diff"]}, indent=1
        )
    )


if __name__ == "__main__":
    main()
