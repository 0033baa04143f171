"""How a policy turns a task's question into prompt tokens: raw text or its own chat template.

With ``PolicyConfig.chat_template`` set, each policy renders the question as a one-turn chat
(an optional ``system_prompt`` first) with *its own* tokenizer's template and
``add_generation_prompt=True``, so two model families see the same question each in the format
it was tuned on. Experience moves between policies as completions only; the receiver re-renders
the prompt in its own format (``encode_prompt``), so nothing of one family's template reaches
another.

The rendered text is encoded without adding special tokens: a template that wants a BOS writes it
itself (Llama 3 does, Qwen2.5 does not). Templates that print today's date (Llama 3.x) get
``date_string = "26 Jul 2024"`` (their own fallback), so a prompt renders the same every day and
runs stay reproducible.
"""

from __future__ import annotations

from pathlib import Path

from mutualrl.config import ConfigError, PolicyConfig

FIXED_DATE = "26 Jul 2024"


def resolve_template(cfg: PolicyConfig, tokenizer) -> str | None:
    """The Jinja template this policy renders with; None renders raw text. Errors name the field."""
    field = f"policies.{cfg.name}.chat_template"
    if cfg.chat_template is False:
        return None
    if cfg.chat_template is True:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                f"{field}: tokenizer {cfg.tokenizer!r} has no chat template; expected "
                "a tokenizer whose tokenizer_config.json has one, a path to a Jinja "
                "template file, or false for raw text"
            )
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        return template
    path = Path(cfg.chat_template)
    if not path.is_file():
        raise ConfigError(
            f"{field}: template file not found: {path} (expected a Jinja file, "
            "true for the tokenizer's own template, or false)"
        )
    return path.read_text(encoding="utf-8")


class ChatPrompt:
    """Renders and encodes questions with one template; encodings are cached per question."""

    def __init__(self, tokenizer, template: str, system_prompt: str | None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt
        self._cache: dict[str, tuple[int, ...]] = {}  # a task has finitely many questions

    def render(self, question: str) -> str:
        messages = [{"role": "user", "content": question}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=True,
            date_string=FIXED_DATE,
        )

    def encode(self, question: str, prefill: str = "") -> tuple[int, ...]:
        """The rendered question, and ``prefill`` as the start of the assistant's answer
        (tokenized with the rendering, as the policy would read its own partial answer)."""
        if prefill:
            return tuple(
                self.tokenizer(self.render(question) + prefill, add_special_tokens=False)[
                    "input_ids"
                ]
            )
        ids = self._cache.get(question)
        if ids is None:
            ids = tuple(
                self.tokenizer(self.render(question), add_special_tokens=False)["input_ids"]
            )
            self._cache[question] = ids
        return ids


def chat_prompt(cfg: PolicyConfig, tokenizer) -> ChatPrompt | None:
    """The policy's chat rendering, or None when it takes raw text (the default)."""
    template = resolve_template(cfg, tokenizer)
    return None if template is None else ChatPrompt(tokenizer, template, cfg.system_prompt)
