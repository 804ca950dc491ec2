"""``llamacrab.quantize`` and ``llamacrab quantize``: the bytes llama.cpp's own quantizer writes,
written whole or not at all, with its refusals (and its deaths) as clear errors."""

from __future__ import annotations

import _thread
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamacrab import (
    InvalidModelError,
    InvalidParameterError,
    Llama,
    QuantizationError,
    cli,
    quantize,
    quantize_types,
)
from llamacrab._features import quantize as quantize_module
from llamacrab._native.imatrix import read_imatrix

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_llama(tmp_path_factory.mktemp("quantize") / "tiny-f32.gguf")


def llama_cpp_quantized(
    source: Path, dest: Path, file_type: str, imatrix: Path | None = None, keep_split: bool = False
) -> bytes:
    """What llama.cpp's C API writes, called directly (as llama-quantize does) in a child.
    ``imatrix``: an .npz of the importances by tensor name, and its "__recorded__" entry the
    JSON of the metadata llama-quantize records ([key, str or int] pairs)."""
    code = """
        import json, sys
        import numpy as np
        sys.path.insert(0, sys.argv[4])
        from raw import checked
        from llamacrab_sys import ffi, lib
        lib.llama_backend_init()
        params = ffi.new("llama_model_quantize_params *", lib.llama_model_quantize_default_params())
        params.ftype = getattr(lib, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
        params.nthread = 1
        params.keep_split = sys.argv[6] == "1"
        if sys.argv[5]:
            saved = dict(np.load(sys.argv[5]))
            recorded = json.loads(saved.pop("__recorded__").tobytes())
            names = [ffi.new("char[]", name.encode()) for name in saved]
            table = ffi.new("struct llama_model_imatrix_data[]", len(saved) + 1)
            for entry, name, values in zip(table, names, saved.values()):
                entry.name, entry.data = name, ffi.from_buffer("float[]", values)
                entry.size = values.size
            params.imatrix = table
            kv = ffi.new("struct llama_model_kv_override[]", len(recorded) + 1)
            for entry, (key, value) in zip(kv, recorded):
                entry.key = key.encode()
                if isinstance(value, str):
                    entry.tag, entry.val_str = lib.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
                else:
                    entry.tag, entry.val_i64 = lib.LLAMA_KV_OVERRIDE_TYPE_INT, value
            params.kv_overrides = kv
        source, dest = sys.argv[1].encode(), sys.argv[2].encode()
        assert checked(lib.safe_llama_model_quantize, source, dest, params) == 0
    """
    raw = Path(__file__).parent / "sys"
    argv = [sys.executable, "-c", textwrap.dedent(code), str(source), str(dest), file_type,
            str(raw), str(imatrix or ""), "1" if keep_split else "0"]  # fmt: skip
    child = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    return b"" if keep_split else dest.read_bytes()


@pytest.mark.parametrize(
    ("file_type", "described"), [("Q8_0", "Q8_0"), ("q4_k_m", "Q4_K - Medium"), ("F16", "F16")]
)
def test_the_file_is_llama_cpp_s_own_and_loads(
    source: Path, tmp_path: Path, file_type: str, described: str
) -> None:
    before = source.read_bytes()
    written = quantize(source, tmp_path / "out.gguf", file_type, threads=1)
    assert written == tmp_path / "out.gguf"
    reference = llama_cpp_quantized(source, tmp_path / "reference.gguf", file_type.upper())
    assert written.read_bytes() == reference
    assert source.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    umask = os.umask(0)
    os.umask(umask)
    assert written.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file (not 0600)
    with Llama(written, n_ctx=64, n_threads=1) as llm:
        assert llm.model.ftype == described
        assert llm.create_completion("hello", max_tokens=3, temperature=0).usage.completion_tokens


def test_llama_cpp_s_refusal_is_its_reason_and_the_destination_is_untouched(
    source: Path, tmp_path: Path
) -> None:
    quantized = quantize(source, tmp_path / "q8.gguf", "Q8_0")
    dest = tmp_path / "again.gguf"
    dest.write_bytes(b"kept")
    with pytest.raises(QuantizationError, match="requantizing from type q8_0 is disabled"):
        quantize(quantized, dest, "Q4_0")
    assert dest.read_bytes() == b"kept"
    quantize(quantized, dest, "Q4_0", allow_requantize=True)
    with Llama(dest, n_ctx=64, n_threads=1) as llm:
        assert llm.model.ftype == "Q4_0"


def test_two_threads_writing_one_destination_each_write_a_whole_file(
    source: Path, tmp_path: Path
) -> None:
    # The partial file was named by the process id: two threads of one process wrote into
    # the same file, and the first to finish renamed it away from under the second.
    dest = tmp_path / "both.gguf"
    errors: list[BaseException] = []

    def write(file_type: str) -> None:
        try:
            quantize(source, dest, file_type, threads=1)
        except BaseException as error:  # reported below
            errors.append(error)

    writers = [threading.Thread(target=write, args=(t,)) for t in ("Q8_0", "F16")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert errors == []
    with Llama(dest, n_ctx=64, n_threads=1) as llm:  # one of the two, whole
        assert llm.model.ftype in ("Q8_0", "F16")
    assert [p.name for p in tmp_path.iterdir()] == ["both.gguf"]


def test_tensor_types_are_chosen_by_name_and_by_pattern(source: Path, tmp_path: Path) -> None:
    overrides = {"attn_v": "f16", "ffn_.*": "q8_0"}
    written = quantize(source, tmp_path / "mixed.gguf", "Q4_0", output_tensor_type="q5_0",
                       token_embedding_type="F16", tensor_types=overrides)  # fmt: skip
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(written)).tensors}
    assert types["output.weight"] == "Q5_0" and types["token_embd.weight"] == "F16"
    for layer in (0, 1):
        assert types[f"blk.{layer}.attn_v.weight"] == "F16"
        assert types[f"blk.{layer}.attn_q.weight"] == "Q4_0"
        assert {types[f"blk.{layer}.ffn_{part}.weight"] for part in ("up", "down")} == {"Q8_0"}
    # The same from the command line; a type of any case (q4_k is q4_K).
    again = tmp_path / "cli.gguf"
    assert cli.main(["quantize", str(source), str(again), "Q4_0", "--output-tensor-type", "q5_0",
                     "--token-embedding-type", "f16", "--tensor-type", "attn_v=F16",
                     "--tensor-type", "ffn_.*=q8_0"]) == 0  # fmt: skip
    assert again.read_bytes() == written.read_bytes()
    assert "q4_K" in quantize_types(tensors=True) and "i32" not in quantize_types(tensors=True)
    quantize(source, tmp_path / "k.gguf", "Q8_0", tensor_types={"attn_k": "q4_k"})
    with pytest.raises(InvalidParameterError, match=r"tensor_types pattern '\(': missing \)"):
        quantize(source, tmp_path / "bad.gguf", "Q8_0", tensor_types={"(": "q8_0"})
    with pytest.raises(InvalidParameterError, match=r"tensor_types\['x'\] must be one of"):
        quantize(source, tmp_path / "bad.gguf", "Q8_0", tensor_types={"x": "i32"})
    with pytest.raises(InvalidParameterError, match="output_tensor_type must be one of"):
        quantize(source, tmp_path / "bad.gguf", "Q8_0", output_tensor_type="q9")
    assert not (tmp_path / "bad.gguf").exists()


def test_bad_arguments_are_named_before_llama_cpp_runs(source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out.gguf"
    with pytest.raises(InvalidParameterError, match=r"file_type must be one of .*Q4_K_M.*'Q9'"):
        quantize(source, dest, "Q9")
    with pytest.raises(InvalidParameterError, match="threads"):
        quantize(source, dest, "Q8_0", threads=0)
    with pytest.raises(InvalidParameterError, match="pure must be True or False"):
        quantize(source, dest, "Q8_0", pure="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="dest would replace the source itself"):
        quantize(source, source, "Q8_0")
    with pytest.raises(InvalidParameterError, match="dest is a folder"):
        quantize(source, tmp_path, "Q8_0")
    with pytest.raises(InvalidParameterError, match="folder does not exist"):
        quantize(source, tmp_path / "missing" / "out.gguf", "Q8_0")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(InvalidModelError, match="not a valid GGUF"):
        quantize(not_gguf, dest, "Q8_0")
    assert not dest.exists()
    assert "Q4_K_M" in quantize_types() and "F32" in quantize_types()


def put_child(monkeypatch: pytest.MonkeyPatch, folder: Path, body: str) -> None:
    """Have quantize run ``body`` as its child instead of llama.cpp's quantizer."""
    (folder / "stand_in_child.py").write_text(textwrap.dedent(body))
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setattr(quantize_module, "CHILD_MODULE", "stand_in_child")


def test_a_child_that_dies_is_an_error_and_leaves_nothing(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp's quantizer aborts on some inputs (GGML_ABORT): its process, not ours.
    put_child(monkeypatch, tmp_path, """
        import os, sys
        open(sys.argv[2], "wb").write(b"half a file")
        print("GGML_ASSERT(nelements % block_size == 0) failed", file=sys.stderr)
        os.abort()
    """)  # fmt: skip
    dest = tmp_path / "out.gguf"
    with pytest.raises(QuantizationError, match=r"ended on signal 6 \(GGML_ASSERT"):
        quantize(source, dest, "Q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stand_in_child.py"]


def test_ctrl_c_stops_the_work_at_once(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put_child(monkeypatch, tmp_path, """
        import os, sys, time
        open(sys.argv[2] + ".path", "w").write(os.environ["PYTHONPATH"])
        open(sys.argv[2] + ".pid", "w").write(str(os.getpid()))
        open(sys.argv[2], "wb").write(b"started")
        time.sleep(60)
    """)  # fmt: skip

    def interrupt() -> None:
        while not any(p.suffix == ".pid" for p in tmp_path.iterdir()):
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        quantize(source, tmp_path / "out.gguf", "Q8_0")
    assert time.monotonic() - started < 10
    (pid_file,) = [p for p in tmp_path.iterdir() if p.suffix == ".pid"]
    assert not Path(f"/proc/{pid_file.read_text()}").exists()  # killed and reaped
    assert not (tmp_path / "out.gguf").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []
    # The child imports the llamacrab this process runs, wherever that came from.
    (path_file,) = [p for p in tmp_path.iterdir() if p.suffix == ".path"]
    here = Path(quantize_module.__file__).resolve().parents[2]
    assert path_file.read_text().split(os.pathsep)[0] == str(here)


def test_the_command(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "cli.gguf"
    assert cli.main(["quantize", str(source), str(dest), "Q5_0", "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(dest)
    assert dest.read_bytes() == quantize(source, tmp_path / "api.gguf", "Q5_0").read_bytes()
    assert cli.main(["quantize", str(source), str(dest), "Q9"]) == 1
    assert "file_type must be one of" in capsys.readouterr().err


def write_legacy_imatrix(path: Path, data: dict[str, tuple[np.ndarray, float]]) -> Path:
    """llama-imatrix's first form: entries (name, calls, values), chunk count, dataset."""
    out = [struct.pack("<i", len(data))]
    for name, (sums, count) in data.items():
        out += [struct.pack("<i", len(name)), name.encode(), struct.pack("<ii", int(count),
                len(sums)), sums.astype("<f4").tobytes()]  # fmt: skip
    out += [struct.pack("<ii", 12, len(b"wiki.train.raw")), b"wiki.train.raw"]
    path.write_bytes(b"".join(out))
    return path


def _legacy_int_fields(data: dict[str, tuple[np.ndarray, float]]) -> list[int]:
    """The offsets of every int32 of write_legacy_imatrix's file of ``data``."""
    offsets, at = [0], 4
    for name, (sums, _) in data.items():
        offsets += [at, at + 4 + len(name), at + 8 + len(name)]
        at += 12 + len(name) + 4 * len(sums)
    return [*offsets, at, at + 4]


def test_every_cut_or_bent_field_of_a_legacy_imatrix_is_named_or_quantizes(
    source: Path, tmp_path: Path
) -> None:
    # The legacy form is read by our own parser: each cut (at every byte) and each int32 bent
    # to an extreme is either refused by name before llama.cpp runs, or read as a matrix
    # llama.cpp quantizes with (a sample of them, to keep this short).
    data = tiny.importances()
    whole = write_legacy_imatrix(tmp_path / "whole.dat", data).read_bytes()
    *_, entries_end, _ = fields = _legacy_int_fields(data)
    cuts = [whole[:cut] for cut in range(len(whole))]
    bent = []
    for at in fields:
        (original,) = struct.unpack_from("<i", whole, at)
        for value in {-(2**31), -1, 0, 1, 2**31 - 1, original - 1, original + 1} - {original}:
            bent.append(whole[:at] + struct.pack("<i", value) + whole[at + 4 :])
    for at in range(fields[3] + 4, entries_end, 997):  # a value here and there
        for value in (np.nan, np.inf, -np.inf, 3e38, -1.0):
            bent.append(whole[:at] + struct.pack("<f", value) + whole[at + 4 :])
    imatrix, dest = tmp_path / "bent.dat", tmp_path / "out.gguf"
    readable = []
    for index, variant in enumerate(cuts + bent):
        imatrix.write_bytes(variant)
        try:
            read_imatrix(imatrix)
        except InvalidParameterError as error:
            assert str(imatrix) in str(error)
        else:
            # Only a file whose entries are all there: the chunk count and dataset are optional.
            assert index >= entries_end
            readable.append(variant)
    assert len(readable) < len(bent)  # most bent fields are refused too
    for variant in readable[:: max(1, len(readable) // 12)]:
        imatrix.write_bytes(variant)
        try:
            quantize(source, dest, "Q4_0", threads=1, imatrix=imatrix)
        except QuantizationError as error:  # llama.cpp's refusal (an entry of the wrong size)
            assert "ended on signal" not in str(error)
        else:
            with Llama(dest, n_ctx=64, n_threads=1) as llm:
                assert llm.create_completion("the cat", max_tokens=2).usage.completion_tokens


def test_an_importance_matrix_reaches_llama_cpp_as_llama_quantize_passes_it(
    source: Path, tmp_path: Path
) -> None:
    data = tiny.importances()
    imatrix = tiny.write_gguf_imatrix(tmp_path / "tiny.imatrix", data)
    written = quantize(source, tmp_path / "q4.gguf", "Q4_0", threads=1, imatrix=imatrix)
    expected = {name: sums / np.float32(count) if count else np.ones_like(sums)
                for name, (sums, count) in data.items()}  # fmt: skip
    recorded = [["quantize.imatrix.file", str(imatrix)],
                ["quantize.imatrix.dataset", "wiki.train.raw"],
                ["quantize.imatrix.entries_count", len(data)],
                ["quantize.imatrix.chunks_count", 12]]  # fmt: skip
    saved = tmp_path / "reference.npz"
    np.savez(saved, **expected, __recorded__=np.frombuffer(json.dumps(recorded).encode(), "u1"))
    reference = llama_cpp_quantized(source, tmp_path / "reference.gguf", "Q4_0", saved)
    assert written.read_bytes() == reference
    plain = quantize(source, tmp_path / "plain.gguf", "Q4_0", threads=1)
    assert plain.read_bytes() != reference  # the importances changed the weights' rounding
    fields = gguf.GGUFReader(written).fields
    assert fields["quantize.imatrix.entries_count"].contents() == len(data)
    assert fields["quantize.imatrix.dataset"].contents() == "wiki.train.raw"
    # The legacy .dat form of the same numbers, at the same path: the same file. (It has no
    # "saw no token": its sums are used as they are, so that weight's are ones there.)
    unseen = {name: (np.ones_like(sums), 1.0) for name, (sums, count) in data.items() if not count}
    write_legacy_imatrix(imatrix, {**data, **unseen})
    again = quantize(source, tmp_path / "legacy.gguf", "Q4_0", threads=1, imatrix=imatrix)
    assert again.read_bytes() == reference


def test_a_broken_importance_matrix_is_named_before_llama_cpp_runs(
    source: Path, tmp_path: Path
) -> None:
    data = tiny.importances()
    nan = {**data, "output.weight": (np.full(64, np.nan, dtype=np.float32), 1.0)}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    truncated = tmp_path / "cut.dat"
    truncated.write_bytes(write_legacy_imatrix(tmp_path / "whole.dat", data).read_bytes()[:99])
    broken = [
        (tmp_path / "missing.imatrix", "missing.imatrix does not exist"),
        (tiny.write_gguf_imatrix(tmp_path / "bare.imatrix", data, metadata=False),
         "lacks its metadata: imatrix.datasets"),
        (tiny.write_gguf_imatrix(tmp_path / "sums.imatrix", data, counts=False),
         "has sums or counts, not both"),
        (tiny.write_gguf_imatrix(tmp_path / "nan.imatrix", nan), "output.weight has a non-finite"),
        (truncated, "is truncated"),
        (tiny.write_gguf_imatrix(tmp_path / "bool.imatrix", data, chunks=True),
         "imatrix.chunk_count is True, not a uint32"),
        (fifo, "is not a regular file"),  # opening it would wait for a writer for ever
        (Path("/dev/zero"), "is not a regular file"),  # reading it would never end
    ]  # fmt: skip
    dest = tmp_path / "out.gguf"
    for imatrix, reason in broken:
        with pytest.raises(InvalidParameterError, match=reason):
            quantize(source, dest, "Q4_0", imatrix=imatrix)
    assert not dest.exists()
    # One of another model's shapes: llama.cpp's own refusal.
    other = {**data, "blk.0.attn_q.weight": (np.ones(32, dtype=np.float32), 1.0)}
    mismatched = tiny.write_gguf_imatrix(tmp_path / "other.imatrix", other)
    with pytest.raises(QuantizationError, match="imatrix size 32 is different from tensor size 64"):
        quantize(source, dest, "Q4_0", imatrix=mismatched)
    assert not dest.exists() and [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_names_are_recorded_as_llama_quantize_records_c_strings(
    source: Path, tmp_path: Path
) -> None:
    # A NUL in the dataset's name and a file name that is not UTF-8 failed as kv_overrides
    # errors the caller never passed (a red team's finding).
    imatrix = tmp_path / os.fsdecode(b"odd\xffname.imatrix")
    tiny.write_gguf_imatrix(imatrix, tiny.importances(), dataset="wiki\0train")
    written = quantize(source, tmp_path / "q4.gguf", "Q4_0", threads=1, imatrix=imatrix)
    fields = gguf.GGUFReader(written).fields
    assert fields["quantize.imatrix.dataset"].contents() == "wiki"
    assert fields["quantize.imatrix.file"].contents().endswith("odd\ufffdname.imatrix")


def test_the_command_takes_an_importance_matrix(source: Path, tmp_path: Path) -> None:
    imatrix = tiny.write_gguf_imatrix(tmp_path / "tiny.imatrix", tiny.importances())
    library = quantize(source, tmp_path / "library.gguf", "Q4_0", threads=1, imatrix=imatrix)
    command = tmp_path / "command.gguf"
    argv = ["quantize", str(source), str(command), "Q4_0", "-t", "1", "--imatrix", str(imatrix)]
    assert cli.main(argv) == 0
    assert command.read_bytes() == library.read_bytes()


def test_a_type_that_needs_an_importance_matrix_is_reached_with_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # IQ2_XXS needs rows of 256: the tiny model made wider.
    monkeypatch.setattr(tiny, "N_EMBD", 256)
    monkeypatch.setattr(tiny, "N_FF", 512)
    wide = tiny.write_tiny_llama(tmp_path / "wide.gguf")
    dest = tmp_path / "iq2.gguf"
    with pytest.raises(QuantizationError, match="requires an imatrix") as refused:
        quantize(wide, dest, "IQ2_XXS", threads=1)
    # llama.cpp's banner around its reason was the message's first part.
    assert "offending tensor: blk.0.attn_k.weight" in str(refused.value)
    assert "===" not in str(refused.value)
    rows = {t.name: int(t.shape[0]) for t in gguf.GGUFReader(wide).tensors
            if len(t.shape) == 2 and t.name != "token_embd.weight"}  # fmt: skip
    data = {name: (np.full(n, 2.0, dtype=np.float32), 3.0) for name, n in rows.items()}
    quantize(
        wide, dest, "IQ2_XXS", threads=1, imatrix=tiny.write_gguf_imatrix(tmp_path / "i", data)
    )
    with Llama(dest, n_ctx=64, n_threads=1) as llm:
        assert llm.model.ftype == "IQ2_XXS - 2.0625 bpw"
        assert llm.create_completion("hi", max_tokens=3, min_tokens=3).usage.completion_tokens == 3


def test_a_split_model_keeps_its_parts(tmp_path: Path) -> None:
    parts = tiny.write_tiny_llama_split(tmp_path, "tiny-f32", n_parts=2)
    first = quantize(parts[0], tmp_path / "q8.gguf", "Q8_0", threads=1, keep_split=True)
    names = ["q8-00001-of-00002.gguf", "q8-00002-of-00002.gguf"]
    assert first == tmp_path / names[0] and (tmp_path / names[1]).is_file()
    llama_cpp_quantized(parts[0], tmp_path / "reference", "Q8_0", keep_split=True)
    for name in names:
        reference = tmp_path / name.replace("q8", "reference")
        assert (tmp_path / name).read_bytes() == reference.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []
    with Llama(first, n_ctx=64, n_threads=1) as split:
        assert split.model.ftype == "Q8_0"
        assert split.create_completion("hi", max_tokens=2, min_tokens=2).usage.completion_tokens
    # Without it, one file; and parts that would land on the source's are refused.
    single = quantize(parts[0], tmp_path / "one.gguf", "Q8_0", threads=1)
    assert single.is_file() and not (tmp_path / "one-00001-of-00002.gguf").exists()
    with pytest.raises(InvalidParameterError, match="would replace the source itself"):
        quantize(parts[0], tmp_path / "tiny-f32.gguf", "Q8_0", keep_split=True)
