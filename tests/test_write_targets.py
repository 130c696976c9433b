"""What cflow's writers may replace (cflow.fsutil.write_target): a regular file or nothing. A device,
directory, FIFO or socket at the target is refused with one line and left as it was; a symlink is
written through (its target replaced atomically, the link kept); a missing folder is an error unless
the caller asks for it (`--mkdir`). Device nodes are made with mknod in a temporary folder where the
user may (root); the command line is also tried on the real /dev/null, which a refusal never touches."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from cflow.cli import main
from cflow.fsutil import WriteError, atomic_write_bytes, atomic_write_text, check_writable, write_target

from test_cli import one_error_line


def char_device(path: Path) -> Path:
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the numbers of /dev/null
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def unix_socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def directory(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize("make, kind", [(char_device, "a character device"), (fifo, "a FIFO"),
                                        (unix_socket, "a socket"), (directory, "a directory")])
def test_a_target_that_is_not_a_regular_file_is_refused_and_kept(tmp_path, make, kind):
    target = make(tmp_path / "t")
    before = os.lstat(target)
    for write in (lambda: atomic_write_bytes(target, b"x" * 4096), lambda: check_writable(target, file=True)):
        with pytest.raises(WriteError, match=f"cannot write {target}: it is {kind}.*not a regular file"):
            write()
    after = os.lstat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert sorted(os.listdir(tmp_path)) == ["t"]  # no temporary left beside it


def test_a_symlink_is_written_through_and_kept(tmp_path):
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "file.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert os.listdir(tmp_path / "real") == ["file.txt"] and sorted(os.listdir(tmp_path)) == ["link.txt", "real"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made")
    atomic_write_text(link, "hello")
    assert link.is_symlink() and (tmp_path / "made").read_text() == "hello"


def test_a_symlink_to_a_device_is_refused_naming_both(tmp_path):
    dev = char_device(tmp_path / "dev")
    link = tmp_path / "out.cflow"
    link.symlink_to(dev)
    with pytest.raises(WriteError, match=f"it is a character device \\(the symlink {link} points to {dev}\\)"):
        write_target(link)
    assert stat.S_ISCHR(os.stat(dev).st_mode)


def test_missing_folders_only_when_asked(tmp_path):
    out = tmp_path / "a" / "b" / "f.txt"
    with pytest.raises(WriteError, match=f"the folder {out.parent} does not exist; create it first"):
        atomic_write_text(out, "x")
    assert os.listdir(tmp_path) == []
    atomic_write_text(out, "x", mkdir=True)
    assert out.read_text() == "x"


# ---- the command line ----------------------------------------------------------------------------
@pytest.fixture()
def gguf_file(tmp_path) -> Path:
    pytest.importorskip("gguf")
    from test_convert_gguf import write_gguf

    src = tmp_path / "m.gguf"
    write_gguf(src)
    return src


def test_convert_refuses_a_device_node(tmp_path, gguf_file, capsys):
    dev = char_device(tmp_path / "dev")
    for target in (dev, Path("/dev/null")):
        assert main(["convert", str(gguf_file), str(target)]) == 2
        one_error_line(capsys.readouterr().err, f"cflow convert: error: cannot write {target}: it is a character device")
        assert stat.S_ISCHR(os.stat(target).st_mode)


def test_convert_refuses_a_missing_folder_unless_mkdir(tmp_path, gguf_file, capsys):
    out = tmp_path / "nonexistent_dir" / "out.cflow"
    assert main(["convert", str(gguf_file), str(out)]) == 2
    one_error_line(capsys.readouterr().err, f"the folder {out.parent} does not exist", "--mkdir")
    assert not out.parent.exists()
    assert main(["convert", str(gguf_file), str(out), "--mkdir", "-q"]) == 0
    assert out.is_file()


def test_convert_writes_through_a_symlink(tmp_path, gguf_file):
    real = tmp_path / "models" / "m.cflow"
    real.parent.mkdir()
    link = tmp_path / "m.cflow"
    link.symlink_to(real)
    assert main(["convert", str(gguf_file), str(link), "-q"]) == 0
    assert link.is_symlink() and real.is_file() and real.stat().st_size > 0
