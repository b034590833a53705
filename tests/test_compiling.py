"""The kept compile cache (compiling.KeptCache): its manifest lists what inductor wrote, and a resume
sets aside a folder that no longer matches it instead of failing in the C++ compiler. The run that
compiles, is damaged and compiles cold is tests/e2e/test_compile.py."""

import json
from contextlib import nullcontext

import pytest
from torch._dynamo.utils import counters

from compiling import MANIFEST, KeptCache, keep_compiled_code
from run_folder import LAYOUT

CACHE_FOLDER = LAYOUT["compile_cache"]

LIBRARY = "ab/cab123.main.so"
GRAPH = "fxgraph/x1/fx1/entry"


@pytest.fixture(autouse=True)
def graphs_compiled():
    """Dynamo's count of compiled graphs in this process, which record() reads: set by the tests."""
    before = counters["inductor"]["fxgraph_cache_miss"]
    yield
    counters["inductor"]["fxgraph_cache_miss"] = before


def compiled(graphs: int) -> None:
    counters["inductor"]["fxgraph_cache_miss"] = graphs


def written_cache(tmp_path):
    """A cache folder as inductor leaves it, with its manifest recorded after 4 graphs compiled."""
    folder = tmp_path / CACHE_FOLDER
    for name, content in {
        LIBRARY: b"\x7fELF" + bytes(range(256)) * 8,
        "ab/cab123.main.cpp": b"extern int kernel();",
        GRAPH: b"a pickled graph",
    }.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    (folder / "locks").mkdir()
    (folder / "locks" / "cab123.lock").write_bytes(b"")
    compiled(4)
    KeptCache(folder, writer=True).record()
    return folder


def test_the_manifest_lists_each_cached_file_with_its_size_and_digest(tmp_path):
    folder = written_cache(tmp_path)
    listed = json.loads((folder / MANIFEST).read_text())
    assert sorted(listed) == sorted([LIBRARY, "ab/cab123.main.cpp", GRAPH])  # no locks
    assert listed[LIBRARY][0] == (folder / LIBRARY).stat().st_size
    # recorded again only by the writer, and only when more graphs were compiled
    kept = KeptCache(folder, writer=True)
    assert kept.check() is None  # reads the manifest
    (folder / "cd").mkdir()
    (folder / "cd" / "ccd.py").write_text("def kernel(): pass")
    compiled(0)  # a resumed process: every graph from the cache
    kept.record()
    KeptCache(folder, writer=False).record()
    assert "cd/ccd.py" not in json.loads((folder / MANIFEST).read_text())
    compiled(2)
    kept.record()
    assert sorted(json.loads((folder / MANIFEST).read_text())) == sorted([*listed, "cd/ccd.py"])


def test_an_intact_cache_is_kept_and_a_file_written_after_the_manifest_is_removed(tmp_path):
    """A file the manifest does not list was written after the last checkpoint by a run that was
    then killed (a library may be half-written): removed, so its graph compiles again; the rest is
    kept. Without a manifest (no checkpoint was written) every file is such a file."""
    folder = written_cache(tmp_path)
    (folder / "zz").mkdir()
    (folder / "zz" / "czz.main.so").write_bytes(b"\x7fELF cut")
    assert KeptCache(folder, writer=True).check() is None
    assert (folder / LIBRARY).exists() and (folder / GRAPH).exists()
    assert not (folder / "zz" / "czz.main.so").exists()
    no_manifest(folder)
    assert KeptCache(folder, writer=True).check() is None
    assert not (folder / LIBRARY).exists() and (folder / "locks" / "cab123.lock").exists()


def cut_short(folder):
    path = folder / LIBRARY
    path.write_bytes(path.read_bytes()[:1000])


def garbled(folder):
    path = folder / GRAPH
    path.write_bytes(bytes(len(path.read_bytes())))  # the same size


def missing(folder):
    (folder / GRAPH).unlink()


def no_manifest(folder):
    (folder / MANIFEST).unlink()


def unreadable_manifest(folder):
    (folder / MANIFEST).write_text('{"ab/cab123.main.so": [21')


@pytest.mark.parametrize(
    "damage, said",
    [
        (cut_short, f"{LIBRARY}: 1000 bytes, 2052 written"),
        (garbled, f"{GRAPH}: its content changed"),
        (missing, f"{GRAPH} missing"),
        (unreadable_manifest, f"{MANIFEST} unreadable"),
    ],
)
def test_a_damaged_cache_is_set_aside_with_one_warning_and_compiles_cold(
    tmp_path, damage, said, capsys, monkeypatch
):
    folder = written_cache(tmp_path)
    damage(folder)
    # an older set-aside folder, still holding files (a rename onto an empty folder would pass without
    # removing it), is replaced
    older = tmp_path / "compile_cache.damaged" / "ab" / "older.so"
    older.parent.mkdir(parents=True)
    older.write_bytes(b"from an earlier damage")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    kept = keep_compiled_code(tmp_path / CACHE_FOLDER, writer=True, writer_goes_first=nullcontext)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: the kept compile cache {folder} is damaged ({said}")
    assert lines[0].endswith("set aside as compile_cache.damaged, compiling cold")
    assert not folder.exists()  # inductor starts an empty folder: every graph compiles
    assert (tmp_path / "compile_cache.damaged" / LIBRARY).exists()
    assert not older.exists()
    assert kept.listed == {}


def test_only_the_writer_checks_and_a_folder_the_user_chose_is_left_alone(
    tmp_path, monkeypatch, capsys
):
    folder = written_cache(tmp_path)
    cut_short(folder)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    keep_compiled_code(tmp_path / CACHE_FOLDER, writer=False, writer_goes_first=nullcontext)
    assert folder.exists() and not capsys.readouterr().err
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert (
        keep_compiled_code(tmp_path / CACHE_FOLDER, writer=True, writer_goes_first=nullcontext)
        is None
    )
    assert folder.exists() and not capsys.readouterr().err
