"""Export directories that only ever replace what k2jax wrote, in one atomic swap, and never delete a
file k2jax did not write.

An export is written into a fresh sibling `.k2jax-tmp-<name>.<host>.<pid>.<rand>` (0755 dirs, 0644
files), marked complete with `MARKER` last, and swapped with the destination by one
renameat2(RENAME_EXCHANGE). So a reader sees the old complete export or the new one, never a mix. Where
the filesystem lacks the exchange, the old export is first renamed to `.k2jax-old-...` and `recover` (run
before every write and every load) puts it back if the process died between the two renames.

A destination is replaced only when it is missing, empty, or a previous k2jax export that still holds
exactly the files k2jax wrote: `MARKER` lists them, so a workdir that training has since added steps
to, or an export someone put other files in, is refused. (Exports from before the marker are
recognised by their exact file set and k2jax's byte-for-byte config.json and index formats; they get a
`MARKER` listing their files just before the swap.)

Files that appear in the old export while the new one is written (a user's notes, another tool's output)
are never deleted. The swap re-checks the destination right before it and the swapped-out export right
after it (undoing the swap, atomically again, when someone got in between): either way it refuses with an
`ExportError` naming those files, the old export and the files stay at the destination, and the complete
new export is kept beside it as `<name>.k2jax-new.<host>.<pid>.<rand>` (nothing written is lost; the user
chooses). We refuse rather than carry the files into the new export: the new export then holds exactly
what k2jax wrote, and the user, not k2jax, decides where their files go. An old export is deleted by the
list in its `MARKER` only; anything else still in it afterwards (written through a handle opened inside it
before the swap) is kept as `<name>.k2jax-kept.<host>.<pid>.<rand>`, with a warning. Siblings left by dead
processes of this host are cleaned the same way before each write (a sibling without `MARKER` was never
swapped in, so it holds only k2jax's partial write and is deleted whole). `MARKER` itself appears whole or not
at all (written beside, renamed in), so a SIGKILL at any point never makes k2jax's own export look foreign.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable

import jax
import numpy as np

MARKER = ".k2jax-export"
_TMP, _OLD = ".k2jax-tmp-", ".k2jax-old-"
_HF_FILES = re.compile(r"config\.json|model\.safetensors\.index\.json|model(-\d{5}-of-\d{5})?\.safetensors")
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class ExportError(ValueError):
  """A destination k2jax must not replace, or an export that could not be put in place."""


def check_destination(dst: str, src: str | None = None) -> None:
  """Raises ExportError unless `dst` may be (re)written: not `src`, not above it, ours or empty."""
  d = os.path.realpath(dst)
  if src is not None:
    s = os.path.realpath(src)
    if s == d or s.startswith(d.rstrip(os.sep) + os.sep):
      raise ExportError(f"--dst={dst} contains --src={src}: writing it would destroy the source")
  if not os.path.lexists(dst):
    return
  if not os.path.isdir(dst) or os.path.islink(dst):
    raise ExportError(f"{dst}: exists and is not a directory; refusing to replace it")
  if not os.listdir(dst):
    return
  why = _not_ours(dst)
  if why:
    raise ExportError(
      f"{dst}: not empty and not (only) a k2jax export: {why}; refusing to replace it. Choose a new or "
      "empty directory, or remove it yourself"
    )


def is_export(path: str) -> bool:
  """A directory holding exactly an export k2jax wrote (see the module docstring)."""
  return os.path.isdir(path) and not _not_ours(path)


def _not_ours(path: str) -> str:
  """Empty when `path` holds exactly what a k2jax export wrote, else what is not ours."""
  files = set(_files(path))
  marker = os.path.join(path, MARKER)
  if os.path.isfile(marker):
    written = _marker_files(path)
    if written is None:
      return f"unreadable {MARKER}"
    extra = sorted(files - written - {MARKER})
    return f"files k2jax did not write: {_names(extra)}" if extra else ""
  if all(_HF_FILES.fullmatch(n) for n in files) and _is_our_hf_format(path):
    return ""
  return f"no {MARKER} ({len(files)} files, e.g. {sorted(files)[0]})"


def _marker_files(path: str) -> set[str] | None:
  """The files `path`'s MARKER says k2jax wrote; None when it has none or it is unreadable."""
  try:
    with open(os.path.join(path, MARKER)) as f:
      files = json.load(f)["files"]
    return {str(n) for n in files}
  except (OSError, ValueError, KeyError, TypeError):
    return None


def _foreign(path: str) -> list[str]:
  """Files in `path` k2jax did not write, sorted: not in its MARKER; without one, all but the HF files of
  an export from before the marker."""
  files = set(_files(path))
  written = _marker_files(path)
  if written is None and not os.path.isfile(os.path.join(path, MARKER)):
    written = {n for n in files if _HF_FILES.fullmatch(n)} if _is_our_hf_format(path) else set()
  return sorted(files - (written or set()) - {MARKER})


def _names(files: list[str]) -> str:
  return f"{', '.join(files[:5])}{' ...' if len(files) > 5 else ''}"


def _is_our_hf_format(path: str) -> bool:
  """config.json as k2jax dumps it (sorted keys, indent 2) and an index with only total_size metadata."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      text = f.read()
    if text != json.dumps(json.loads(text), indent=2, sort_keys=True):
      return False
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        return set(json.load(f).get("metadata", {})) == {"total_size"}
    return True
  except (OSError, ValueError, AttributeError):
    return False


def _files(root: str) -> list[str]:
  out = []
  for d, dirs, names in os.walk(root):
    rel = os.path.relpath(d, root)
    out += [n if rel == "." else os.path.join(rel, n) for n in names]
    out += [os.path.join(rel, n) + "/" for n in dirs if os.path.islink(os.path.join(d, n))]
  return out


def write_export(dst: str, kind: str, write: Callable[[str], None], src: str | None = None) -> None:
  """Calls `write(tmp_dir)`, marks it, and swaps it into `dst` (see the module docstring)."""
  dst = os.path.abspath(dst)
  parent, name = os.path.split(dst)
  os.makedirs(parent, mode=0o755, exist_ok=True)
  recover(dst)
  check_destination(dst, src)
  clean_stale(dst)
  tmp = os.path.join(parent, f"{_TMP}{name}.{_tag()}")
  os.mkdir(tmp)
  try:
    os.chmod(tmp, 0o755)
    write(tmp)
    # Last: an export without MARKER is incomplete. Its scratch file sits inside `tmp`, which is deleted whole
    # while it has no MARKER.
    _write_marker(tmp, kind, os.path.join(tmp, f"{MARKER}.{_tag()}"))
    _fix_modes(tmp)
    _fsync_tree(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)  # never swapped in: only what this call wrote
    raise
  # From here `tmp` may hold the old export: on any failure it is left for `clean_stale`, never rmtree'd.
  old = _swap_into_place(tmp, dst, parent, name, kind)
  if old is not None:
    remove_export(old, dst)


def recover(dst: str) -> None:
  """Puts back the previous export if a writer died between its two renames (no-exchange filesystems)."""
  dst = os.path.abspath(dst)
  if os.path.lexists(dst):
    return
  parent, name = os.path.split(dst)
  for old in _siblings(parent, name, _OLD):
    if not _alive(old):
      try:
        os.rename(os.path.join(parent, old), dst)
        return
      except FileNotFoundError:
        continue  # another process recovered it first


def clean_stale(dst: str) -> None:
  """Cleans temp/old siblings of `dst` left by dead processes of this host (`remove_export`; a temp
  sibling without MARKER was never swapped in and is deleted whole)."""
  parent, name = os.path.split(os.path.abspath(dst))
  for prefix in (_TMP, _OLD):
    for entry in _siblings(parent, name, prefix):
      path = os.path.join(parent, entry)
      if _alive(entry):
        continue
      if os.path.isfile(path) and not os.path.islink(path):  # a MARKER's scratch (`_mark_unmarked`)
        os.unlink(path)
      elif os.path.isfile(os.path.join(path, MARKER)):
        remove_export(path, dst)
      else:
        shutil.rmtree(path, ignore_errors=True)


def remove_export(path: str, dst: str) -> None:
  """Deletes the files `path`'s MARKER lists (the marker last), then its empty directories. Anything left
  is not k2jax's: the directory is kept as `<dst>.k2jax-kept.<tag>`, with a warning naming the files."""
  written = _marker_files(path) or set()
  for rel in sorted(written):
    try:
      os.unlink(os.path.join(path, rel.rstrip("/")))  # "x/" in a manifest is a symlink to a directory
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
      pass
  try:
    os.unlink(os.path.join(path, MARKER))
  except FileNotFoundError:
    pass
  for d, _, _ in os.walk(path, topdown=False):
    try:
      os.rmdir(d)
    except OSError:
      pass  # not empty: holds what k2jax did not write
  if not os.path.lexists(path):
    return
  kept = f"{os.path.abspath(dst)}.k2jax-kept.{_tag()}"
  os.rename(path, kept)
  logging.warning(
    "%s: files k2jax did not write were in the old export when it was replaced: %s; kept them at %s",
    dst,
    _names(sorted(_files(kept))),
    kept,
  )


def _swap_into_place(tmp: str, dst: str, parent: str, name: str, kind: str) -> str | None:
  """Puts the complete export `tmp` at `dst`; returns where the old export now is (None: there was none).
  Refuses (ExportError, nothing replaced) when `dst` holds files k2jax did not write."""
  if not os.path.lexists(dst):
    try:
      os.rename(tmp, dst)
      return None
    except OSError as e:  # someone made a non-empty `dst` meanwhile
      if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
        raise
      _refuse(tmp, dst, _foreign(dst))
  _mark_unmarked(dst, kind)
  foreign = _foreign(dst)  # written while the new export was
  if foreign:
    _refuse(tmp, dst, foreign)
  if _exchange(tmp, dst):
    foreign = _foreign(tmp)  # written between the check and the exchange
    if foreign:
      _exchange(tmp, dst)  # undone: the old export and those files are back at dst
      _refuse(tmp, dst, foreign)
    return tmp
  old = os.path.join(parent, f"{_OLD}{name}.{_tag()}")
  os.rename(dst, old)  # the window `recover` closes: dst missing, old complete beside it
  foreign = _foreign(old)
  if foreign:
    os.rename(old, dst)
    _refuse(tmp, dst, foreign)
  os.rename(tmp, dst)
  return old


def _mark_unmarked(dst: str, kind: str) -> None:
  """Gives an empty destination, or an intact export from before the marker, a MARKER listing its files:
  once swapped out it is then deleted by that list, and a sibling without MARKER is always a partial write."""
  if os.path.isfile(os.path.join(dst, MARKER)) or (os.listdir(dst) and _not_ours(dst)):
    return
  # The scratch file is a temp sibling of `dst`, not a file in it: left there by a kill it would make the
  # export look foreign (a file k2jax did not list) and every later export would refuse it.
  parent, name = os.path.split(dst)
  _write_marker(dst, kind, os.path.join(parent, f"{_TMP}{name}.{_tag()}"))


def _write_marker(path: str, kind: str, scratch: str) -> None:
  """Gives `path` a MARKER listing its files, whole or not at all: written to `scratch` (same filesystem),
  synced, renamed in. Written in place, a SIGKILL between its open and its close left an empty MARKER, which
  lists nothing: k2jax's own export then looked foreign and was kept aside as `.k2jax-kept.*`."""
  manifest = {"kind": kind, "written_by": "k2jax", "files": sorted(_files(path))}
  with open(scratch, "w") as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.chmod(scratch, 0o644)
  os.rename(scratch, os.path.join(path, MARKER))


def _refuse(new: str, dst: str, foreign: list[str]) -> None:
  kept = f"{dst}.k2jax-new.{_tag()}"
  os.rename(new, kept)
  raise ExportError(
    f"{dst}: files k2jax did not write appeared there while the export ran: {_names(foreign)}; refusing to "
    f"replace it. Nothing was deleted: {dst} still holds the previous export and those files, and the new "
    f"export is complete at {kept}. Move those files elsewhere and export again (or use {kept} as it is)"
  )


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths; False where the kernel, libc or filesystem cannot."""
  libc = ctypes.CDLL(None, use_errno=True)
  fn = getattr(libc, "renameat2", None)
  if fn is None:
    return False
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _tag() -> str:
  return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def _siblings(parent: str, name: str, prefix: str) -> list[str]:
  """Temp/old siblings of `name` written on this host (other hosts' writers cannot be checked)."""
  own = re.compile(re.escape(f"{prefix}{name}.{socket.gethostname()}.") + r"\d+\.[0-9a-f]{8}")
  try:
    return sorted(e for e in os.listdir(parent) if own.fullmatch(e))
  except FileNotFoundError:
    return []


def _alive(entry: str) -> bool:
  """Whether the writer process named in a sibling of this host may still be running."""
  pid = entry.rsplit(".", 2)[1]
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _fix_modes(root: str) -> None:
  for d, dirs, files in os.walk(root):
    os.chmod(d, 0o755)
    for f in files:
      os.chmod(os.path.join(d, f), 0o644)


def _fsync_tree(root: str) -> None:
  """Data and directory entries on disk before the swap makes them the export."""
  for d, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(d, f), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


TEXT_BYTES = 4096  # room for a path or an error message sent between processes


def broadcast_text(text: str) -> str:
  """Process 0's `text` on every process (a collective: every process calls it); a path or an error
  message, UTF-8, at most TEXT_BYTES. The writers use it to hand process 0's temporary directory (or
  its failure, prefixed with NUL) to the others."""
  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils

  return decode_text(multihost_utils.broadcast_one_to_all(encode_text(text)))


def encode_text(text: str) -> np.ndarray:
  """`text` as a fixed-size uint8 array for collectives: 4-byte length, then its UTF-8 (cut at TEXT_BYTES)."""
  raw = text.encode()[:TEXT_BYTES]
  buf = np.zeros(TEXT_BYTES + 4, np.uint8)
  buf[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), np.uint8)
  buf[4 : 4 + len(raw)] = np.frombuffer(raw, np.uint8)
  return buf


def decode_text(buf) -> str:
  got = np.asarray(buf, np.uint8)
  n = int(np.frombuffer(got[:4].tobytes(), np.uint32)[0])
  return got[4 : 4 + n].tobytes().decode(errors="replace")
