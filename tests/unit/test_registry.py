"""The model registry on disk (tokenmill.registry): immutable versions with manifests, aliases, how ids resolve,
removal rules, verification, atomic and concurrent writes, and `tokenmill models` from the command line.

References in plain sight: HF transformers' parameter count, hashlib's sha256, os.stat's inode numbers,
and a GGUF written with the gguf package's own GGUFWriter."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.tiny_models import hf_model, make_tiny_model
from tokenmill.cli import main
from tokenmill.registry import (
    Manifest,
    Registry,
    RegistryBusyError,
    RegistryCorruptError,
    RegistryError,
    UnknownModelError,
)
from tokenmill.registry import files as registry_files
from tokenmill.registry.store import default_registry_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "qwen2", "qwen2", seed=1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama GGUF of two tensors: one Q8_0 (64 x 64), one F32 norm (64); file type MOSTLY_Q8_0."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "registry")


def _leftovers(registry: Registry) -> list[str]:
    tmp = registry.root / ".tmp"
    return sorted(os.listdir(tmp)) if tmp.is_dir() else []


# --- adding: manifests and files ---


def test_manifest_describes_the_hf_folder(registry: Registry, llama_folder: Path) -> None:
    m = registry.add("llama", llama_folder).manifest
    reference_params = sum(p.numel() for p in hf_model(llama_folder).parameters())
    assert (m.name, m.version, m.format) == ("llama", "1", "hf")
    assert m.architecture == "LlamaForCausalLM"
    assert m.parameters == reference_params
    assert (m.dtype, m.quantization, m.context_length) == ("float32", None, 512)
    assert datetime.fromisoformat(m.created).tzinfo is not None
    assert m.source == str(llama_folder.resolve())


def test_manifest_records_each_files_size_and_sha256(registry: Registry, llama_folder: Path) -> None:
    m = registry.add("llama", llama_folder).manifest
    assert sorted(f.path for f in m.files) == sorted(os.listdir(llama_folder))
    for entry in m.files:
        data = (llama_folder / entry.path).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest()
        assert entry.size == len(data)
    on_disk = json.loads((registry.root / "models" / "llama" / "1" / "manifest.json").read_text())
    assert on_disk["files"][0]["sha256"] == m.files[0].sha256


def test_files_are_hard_links_to_the_source_on_one_filesystem(registry: Registry, llama_folder: Path) -> None:
    version = registry.add("llama", llama_folder)
    for entry in version.manifest.files:
        assert (version.files_dir / entry.path).stat().st_ino == (llama_folder / entry.path).stat().st_ino


def test_copy_stores_files_of_their_own(registry: Registry, llama_folder: Path) -> None:
    version = registry.add("llama", llama_folder, copy=True)
    stored, source = version.files_dir / "model.safetensors", llama_folder / "model.safetensors"
    assert stored.stat().st_ino != source.stat().st_ino
    assert stored.read_bytes() == source.read_bytes()


def test_gguf_manifest_reads_architecture_params_type_and_context(registry: Registry, tiny_gguf: Path) -> None:
    version = registry.add("tiny", tiny_gguf)
    m = version.manifest
    assert (m.format, m.architecture, m.context_length) == ("gguf", "llama", 256)
    assert m.parameters == 64 * 64 + 64
    assert (m.dtype, m.quantization) == ("Q8_0", "Q8_0")
    assert version.model_path == version.files_dir / "tiny.Q8_0.gguf"
    assert m.files[0].sha256 == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()


def test_versions_left_out_take_the_next_integer(registry: Registry, llama_folder: Path) -> None:
    assert registry.add("llama", llama_folder).version == "1"
    assert registry.add("llama", llama_folder).version == "2"
    registry.add("llama", llama_folder, version="ft")
    assert registry.add("llama", llama_folder).version == "3"


def test_adding_an_existing_version_again_is_refused(registry: Registry, llama_folder: Path, qwen_folder: Path) -> None:
    first = registry.add("m", llama_folder, version="v1")
    with pytest.raises(RegistryError, match=r"m@v1 already exists and versions are immutable"):
        registry.add("m", qwen_folder, version="v1")
    assert registry.resolve("m@v1").manifest == first.manifest


@pytest.mark.parametrize("name", ["a/b", "..", ".hidden", "x@1", "", "a b"])
def test_names_outside_the_pattern_are_refused(registry: Registry, llama_folder: Path, name: str) -> None:
    with pytest.raises(RegistryError, match="letters, digits"):
        registry.add(name, llama_folder)


def test_integer_versions_with_leading_zeros_are_refused(registry: Registry, llama_folder: Path) -> None:
    with pytest.raises(RegistryError, match="write it as 7"):
        registry.add("m", llama_folder, version="007")


# --- resolving ---


def test_resolve_by_name_at_version_alias_and_bare_name(
    registry: Registry, llama_folder: Path, qwen_folder: Path
) -> None:
    registry.add("m", llama_folder)
    registry.add("m", qwen_folder, alias="m-stable")
    assert registry.resolve("m@1").manifest.architecture == "LlamaForCausalLM"
    assert registry.resolve("m@2").manifest.architecture == "Qwen2ForCausalLM"
    assert registry.resolve("m-stable").id == "m@2"
    assert registry.resolve("m").id == "m@2"  # the highest version
    registry.set_alias("m-stable", "m@1")  # a rollback
    assert registry.resolve("m-stable").id == "m@1"


def test_bare_name_goes_through_the_alias_named_like_it(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder)
    registry.add("m", llama_folder)
    registry.set_alias("m", "m@1")  # pins the name's default version
    assert registry.resolve("m").id == "m@1"


def test_integer_versions_order_numerically_and_named_ones_after_them(registry: Registry, llama_folder: Path) -> None:
    for version in ["2", "10", "beta", "9", "alpha"]:
        registry.add("m", llama_folder, version=version)
    assert [v.version for v in registry.list()] == ["2", "9", "10", "beta", "alpha"]  # named: by created
    assert registry.resolve("m").id == "m@alpha"


def test_unknown_id_names_what_the_registry_holds(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder, alias="stable")
    for unknown in ["nope", "m@9", "nope@1", "../m"]:
        with pytest.raises(UnknownModelError, match=r"it holds: m@1, stable \(-> m@1\)") as info:
            registry.resolve(unknown)
        assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_unknown_id_in_an_empty_registry_says_how_to_add_one(registry: Registry) -> None:
    with pytest.raises(UnknownModelError, match="is empty; add one with `tokenmill models add NAME PATH`"):
        registry.resolve("m")


# --- aliases ---


def test_an_alias_may_not_take_another_models_name(registry: Registry, llama_folder: Path) -> None:
    registry.add("a", llama_folder)
    registry.add("b", llama_folder)
    with pytest.raises(RegistryError, match="would hide the model 'b'"):
        registry.set_alias("b", "a@1")
    with pytest.raises(RegistryError, match="would hide the model 'a'"):
        registry.add("b", llama_folder, alias="a")


def test_a_model_may_not_take_an_aliases_name(registry: Registry, llama_folder: Path) -> None:
    registry.add("a", llama_folder, alias="stable")
    with pytest.raises(RegistryError, match="'stable' is an alias of a@1"):
        registry.add("stable", llama_folder)


def test_aliases_are_stored_in_one_json_file(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder, alias="stable")
    registry.set_alias("latest", "m")
    assert json.loads((registry.root / "aliases.json").read_text()) == {"latest": "m@1", "stable": "m@1"}
    registry.remove_alias("latest")
    assert registry.aliases() == {"stable": "m@1"}
    with pytest.raises(UnknownModelError, match=r"no alias 'latest'.*\(aliases: stable\)"):
        registry.remove_alias("latest")


# --- removing ---


def test_removing_a_version_an_alias_points_at_is_refused(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder, alias="stable")
    with pytest.raises(RegistryError, match=r"aliases point at it \(stable -> m@1\).*--force"):
        registry.remove("m@1")
    assert registry.resolve("m@1").id == "m@1"


def test_forced_removal_removes_the_version_and_its_aliases(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder, alias="stable")
    registry.add("m", llama_folder)
    assert [v.id for v in registry.remove("m@1", force=True)] == ["m@1"]
    assert [v.id for v in registry.list()] == ["m@2"]
    assert registry.aliases() == {}
    assert _leftovers(registry) == []


def test_removing_a_bare_name_removes_every_version(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder)
    registry.add("m", llama_folder, alias="stable")
    registry.add("other", llama_folder)
    with pytest.raises(RegistryError, match="stable -> m@2"):
        registry.remove("m")
    assert sorted(v.id for v in registry.remove("m", force=True)) == ["m@1", "m@2"]
    assert [v.id for v in registry.list()] == ["other@1"]
    assert not (registry.root / "models" / "m").exists()


def test_removing_an_alias_as_a_model_points_to_remove_alias(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder, alias="stable")
    with pytest.raises(RegistryError, match="is an alias of m@1, not a model"):
        registry.remove("stable")


# --- verify ---


def test_verify_passes_an_intact_version(registry: Registry, llama_folder: Path) -> None:
    registry.add("m", llama_folder)
    assert registry.verify("m").id == "m@1"


def test_verify_names_a_missing_file(registry: Registry, llama_folder: Path) -> None:
    version = registry.add("m", llama_folder)
    (version.files_dir / "config.json").unlink()
    with pytest.raises(RegistryCorruptError, match="m@1 is corrupt: config.json is missing"):
        registry.verify(version)


def test_verify_names_a_file_with_a_flipped_byte(registry: Registry, llama_folder: Path) -> None:
    version = registry.add("m", llama_folder, copy=True)  # a copy: the flip must not reach the source
    weights = version.files_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RegistryCorruptError, match="model.safetensors's sha256 differs"):
        registry.verify("m@1")


def test_verify_fails_on_a_weight_file_the_manifest_does_not_list(registry: Registry, llama_folder: Path) -> None:
    version = registry.add("m", llama_folder)
    (version.files_dir / "extra.safetensors").write_bytes(b"weights the loader would read too")
    with pytest.raises(RegistryCorruptError, match="m@1 is corrupt: extra.safetensors is in its files but not"):
        registry.verify(version)


def test_verify_rehashes_only_files_whose_inode_mtime_or_size_changed(
    registry: Registry, llama_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version = registry.add("m", llama_folder, copy=True)
    hashed: list[str] = []
    real_sha256 = registry_files.sha256_of

    def counting_sha256(path: Path) -> str:
        hashed.append(path.name)
        return real_sha256(path)

    monkeypatch.setattr(registry_files, "sha256_of", counting_sha256)
    registry.verify(version)
    first = sorted(hashed)
    hashed.clear()
    registry.verify(version)
    assert first == sorted(f.path for f in version.manifest.files) and hashed == []
    weights = version.files_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched: read it again
    registry.verify(version)
    assert hashed == ["model.safetensors"]


# --- atomic and concurrent writes ---


@pytest.mark.parametrize("problem", ["missing path", "no config.json"])
def test_a_failed_add_leaves_no_version_and_no_temp_folder(
    registry: Registry, tmp_path: Path, problem: str, llama_folder: Path
) -> None:
    registry.add("m", llama_folder)  # the registry exists, with its .tmp folder
    source = tmp_path / "src"
    if problem == "no config.json":
        source.mkdir()
        (source / "model.safetensors").write_bytes(b"")
    with pytest.raises(RegistryError, match="does not exist" if problem == "missing path" else "no config.json"):
        registry.add("m", source)
    assert [v.id for v in registry.list()] == ["m@1"]
    assert _leftovers(registry) == []


def test_an_add_failing_midway_leaves_no_version_and_no_temp_folder(
    registry: Registry, llama_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def hash_then_fail(path: Path) -> str:
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return "0" * 64

    monkeypatch.setattr("tokenmill.registry.store.sha256_of", hash_then_fail)
    with pytest.raises(OSError, match="disk full"):
        registry.add("m", llama_folder)
    assert registry.list() == []
    assert not (registry.root / "models" / "m").exists()
    assert _leftovers(registry) == []


def test_the_next_write_clears_what_a_crashed_writer_left(registry: Registry, llama_folder: Path) -> None:
    half_built = registry.root / ".tmp" / "add-m-crashed"
    (half_built / "files").mkdir(parents=True)
    registry.add("m", llama_folder)
    assert _leftovers(registry) == []


def test_writes_hold_an_exclusive_lock(registry: Registry, llama_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = []
    real_lock = registry_files.exclusive_lock

    def recording_lock(path: Path, timeout_s: float | None = None) -> AbstractContextManager[None]:
        held.append(path)
        return real_lock(path, timeout_s)

    monkeypatch.setattr("tokenmill.registry.store.exclusive_lock", recording_lock)
    registry.add("m", llama_folder, alias="a")  # twice: to open its staging folder, then to rename it in
    registry.set_alias("b", "m@1")
    registry.remove("m", force=True)
    assert held == [registry.root / ".lock"] * 4


def test_add_hashes_outside_the_lock_and_other_writes_go_on_meanwhile(
    tmp_path: Path, llama_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry(tmp_path / "registry", lock_timeout_s=5.0)
    registry.add("m", llama_folder)
    hashing, release = threading.Event(), threading.Event()
    real_sha256 = registry_files.sha256_of

    def slow_sha256(path: Path) -> str:  # a file of many GB
        hashing.set()
        release.wait(10)
        return real_sha256(path)

    monkeypatch.setattr("tokenmill.registry.store.sha256_of", slow_sha256)
    adding = threading.Thread(target=registry.add, args=("m", llama_folder))
    adding.start()
    assert hashing.wait(10)
    registry.set_alias("stable", "m@1")  # neither waits for the hashing nor clears its staging folder
    release.set()
    adding.join(30)
    assert [v.id for v in registry.list()] == ["m@1", "m@2"] and registry.aliases() == {"stable": "m@1"}
    registry.verify("m@2")
    assert _leftovers(registry) == []


def test_a_write_waiting_past_the_lock_timeout_is_a_clear_error(tmp_path: Path, llama_folder: Path) -> None:
    registry = Registry(tmp_path / "registry", lock_timeout_s=0.2)
    registry.add("m", llama_folder)
    with registry_files.exclusive_lock(registry.root / ".lock"):  # another writer, holding on
        with pytest.raises(RegistryBusyError, match="another writer has held the registry lock .* retry"):
            registry.set_alias("stable", "m@1")
    assert registry.aliases() == {}


def test_two_processes_adding_at_once_get_distinct_whole_versions(registry: Registry, llama_folder: Path) -> None:
    script = (
        "import sys\nfrom tokenmill.registry import Registry\n"
        "for _ in range(3): Registry(sys.argv[1]).add('m', sys.argv[2], copy=True)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(registry.root), str(llama_folder)], cwd=REPO)
        for _ in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert [v.version for v in registry.list()] == ["1", "2", "3", "4", "5", "6"]
    for version in registry.list():
        registry.verify(version)
    assert _leftovers(registry) == []


def test_default_folder_moves_with_tokenmill_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    assert default_registry_dir() == tmp_path / "cache" / "registry"
    assert Registry().root == tmp_path / "cache" / "registry"


# --- tokenmill models ---


def _cli(registry: Registry, *argv: str) -> None:
    main(["models", *argv, "--registry", str(registry.root)])


def test_cli_add_alias_and_list_json(
    registry: Registry, llama_folder: Path, tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli(registry, "add", "m", str(llama_folder), "--alias", "stable")
    _cli(registry, "add", "m", str(tiny_gguf), "--version", "q8")
    _cli(registry, "alias", "latest", "m@q8")
    capsys.readouterr()
    _cli(registry, "list", "--json")
    listed = json.loads(capsys.readouterr().out)
    assert [(e["id"], e["aliases"]) for e in listed] == [("m@1", ["stable"]), ("m@q8", ["latest"])]
    assert listed[1]["dtype"] == "Q8_0" and listed[1]["path"].endswith("tiny.Q8_0.gguf")


def test_cli_list_prints_a_table(registry: Registry, llama_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cli(registry, "add", "m", str(llama_folder), "--alias", "stable")
    capsys.readouterr()
    _cli(registry, "list")
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["ID", "ARCHITECTURE", "PARAMS", "DTYPE", "CONTEXT", "SIZE", "CREATED", "ALIASES"]
    assert row.split()[:5] == ["m@1", "LlamaForCausalLM", "139.6K", "float32", "512"]
    assert row.endswith("stable")


def test_cli_show_json_is_the_manifest(
    registry: Registry, llama_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = registry.add("m", llama_folder)
    _cli(registry, "show", "m", "--json")
    shown = json.loads(capsys.readouterr().out)
    assert {k: shown[k] for k in version.manifest.to_dict()} == json.loads(json.dumps(version.manifest.to_dict()))


def test_cli_rm_verify_and_alias_remove(
    registry: Registry, llama_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli(registry, "add", "m", str(llama_folder), "--alias", "stable")
    _cli(registry, "verify", "stable")
    _cli(registry, "alias", "stable", "--remove")
    _cli(registry, "rm", "m@1")
    out = capsys.readouterr().out
    assert "m@1: 3 files match the manifest" in out and "removed alias stable" in out and "removed m@1" in out
    assert registry.list() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show", "nope"], "no model, version or alias 'nope'"),
        (["add", "m", "/does/not/exist"], "does not exist"),
        (["rm", "m@1"], "aliases point at it"),
        (["alias", "stable"], "name the version"),
    ],
)
def test_cli_errors_are_one_line_and_exit_1(
    registry: Registry, llama_folder: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    registry.add("m", llama_folder, alias="stable")
    with pytest.raises(SystemExit) as exit_info:
        _cli(registry, *argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill models: error: ") and message in err
    assert err.count("\n") == 1


def test_cli_corrupt_version_fails_verify(
    registry: Registry, llama_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = registry.add("m", llama_folder)
    (version.files_dir / "generation_config.json").unlink()
    with pytest.raises(SystemExit) as exit_info:
        _cli(registry, "verify", "m")
    assert exit_info.value.code == 1
    assert "generation_config.json is missing" in capsys.readouterr().err


def test_a_lora_adapter_is_a_version_of_its_own(llama_folder: Path, tmp_path: Path) -> None:
    """An adapter folder is stored and verified like a model, recorded as format "lora" with its rank and
    base; the server's catalog never offers it as a model to load (it is served on its base)."""
    from tests.e2e.test_lora_adapter import make_adapter
    from tokenmill.server.pool.catalog import Catalog

    folder, peft_model = make_adapter(llama_folder, tmp_path / "sql", r=8)
    registry = Registry(tmp_path / "reg")
    registry.add("base", llama_folder)
    version = registry.add("sql", folder, alias="sql-stable")
    m = version.manifest
    assert (m.format, m.architecture, m.base_model) == ("lora", "LoRA r=8", str(llama_folder))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {f.path for f in m.files}
    assert m.parameters == sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert registry.verify("sql-stable").model_path == version.files_dir
    packed = version.files_dir / ".tokenmill-packed"  # the loader's packed-weights cache is not the version's
    packed.mkdir()
    (packed / "0123.safetensors").write_bytes(b"packed")
    registry.verify("sql@1")
    (version.files_dir / "stray.safetensors").write_bytes(b"x")
    with pytest.raises(RegistryCorruptError, match="stray.safetensors is in its files but not in its manifest"):
        registry.verify("sql@1")
    assert Manifest.read(version.folder) == m
    catalog = Catalog(registry)
    assert [model_id for model_id, _ in catalog.served_ids()] == ["base@1", "base"]
    with pytest.raises(UnknownModelError, match="sql@1 is a LoRA adapter .* --lora-modules NAME=sql@1"):
        catalog.resolve("sql-stable")
