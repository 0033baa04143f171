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

Templates run only inside transformers' Jinja sandbox. What the sandbox refuses (a template
reaching for ``''.__class__``), a template that is no valid Jinja, and one that renders for
longer than ``RENDER_TIMEOUT_S`` (two nested ``range(100000)`` loops) are each one
``ConfigError`` naming the policy and the template's file; ``check_policies`` renders every
policy's template once before the run folder is written. Rendering runs in a daemon thread that
is waited on for the time limit: a pure-Python loop cannot be stopped from outside, so a runaway
one is left behind, spinning, while the error ends the command.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from mutualrl.config import ConfigError, PolicyConfig

FIXED_DATE = "26 Jul 2024"
# A chat template renders one question in well under a millisecond; ten seconds is a loop.
RENDER_TIMEOUT_S = 10.0


def template_origin(cfg: PolicyConfig, tokenizer) -> str:
    """The file the policy's template comes from, for messages."""
    if cfg.chat_template not in (True, False):
        return str(cfg.chat_template)
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or cfg.tokenizer))
    if folder.is_dir():
        jinja = folder / "chat_template.jinja"  # transformers 5 saves the template apart
        return str(jinja if jinja.is_file() else folder / "tokenizer_config.json")
    return f"tokenizer {cfg.tokenizer!r}"


def _within(seconds: float, render: Callable[[], str]) -> str | None:
    """``render()``, or None when it has not returned after ``seconds``; its error is raised."""
    done: dict = {}

    def target() -> None:
        try:
            done["text"] = render()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            done["error"] = exc

    thread = threading.Thread(target=target, name="chat-template", daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in done:
        raise done["error"]
    return done.get("text")


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

    def __init__(
        self, tokenizer, template: str, system_prompt: str | None, origin: str = "the policy"
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt
        self.origin = origin  # "policies.NAME.chat_template (FILE)", for the errors
        self._cache: dict[str, tuple[int, ...]] = {}  # a task has finitely many questions

    def render(self, question: str) -> str:
        """The question as the policy's chat prompt; the sandbox's refusal, a broken template or
        a render past ``RENDER_TIMEOUT_S`` is one ``ConfigError`` naming the template."""
        from jinja2.exceptions import SecurityError, TemplateError

        messages = [{"role": "user", "content": question}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        try:
            text = _within(
                RENDER_TIMEOUT_S,
                lambda: self.tokenizer.apply_chat_template(
                    messages,
                    chat_template=self.template,
                    tokenize=False,
                    add_generation_prompt=True,
                    date_string=FIXED_DATE,
                ),
            )
        except SecurityError as exc:
            raise ConfigError(
                f"{self.origin}: the chat template was stopped by Jinja's sandbox ({exc}); "
                "templates run only sandboxed: fix it, give a template file, or false for raw text"
            ) from None
        except TemplateError as exc:
            raise ConfigError(f"{self.origin}: the chat template fails to render: {exc}") from None
        if text is None:
            raise ConfigError(
                f"{self.origin}: the chat template rendered for over {RENDER_TIMEOUT_S:g} s "
                "without finishing (a loop that does not end?); a prompt renders in well under "
                "a second"
            )
        return text

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
    if template is None:
        return None
    origin = f"policies.{cfg.name}.chat_template ({template_origin(cfg, tokenizer)})"
    return ChatPrompt(tokenizer, template, cfg.system_prompt, origin)
