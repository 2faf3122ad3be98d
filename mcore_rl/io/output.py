"""Output folders that appear only when complete and never replace what is not ours to replace.

Every command that writes a folder (conversion, model and training checkpoints, run outputs) goes through
:class:`OutputFolder`::

    out = OutputFolder.plan(args.out, flag="--out", inputs=[args.hf_dir], overwrite=args.overwrite)
    tmp = out.begin()          # exclusive: os.mkdir of .<name>.mcore_rl-staging-<pid>-<token>, marker inside
    try:
        ...write into tmp...
        out.commit()           # fsync everything, then rename into place (never over a concurrent writer)
    except BaseException:
        out.abort()            # removes only the staging folder this process created
        raise

The rules, checked by :meth:`OutputFolder.plan` before anything is written (paths compared as real paths,
symlinks resolved):

- never the current directory, the home folder, the filesystem root, or a folder containing one of them;
- never an input, a folder inside an input, or a folder containing an input (``--overwrite`` or not);
- never a symlink or an existing non-folder (a user's file is never renamed or deleted);
- an existing non-empty folder only with ``overwrite``, or, with ``replace_ours``, when it carries our
  :data:`MARKER_FILE` (a training checkpoint replacing its previous save).

Staging folders carry a name only we produce and a marker naming their process; the next run into the same
folder removes stale ones whose process is gone (with a message), and restores a previous output that a
killed process had moved aside. Nothing that is not provably ours is ever removed.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.io.errors import OutputError, note
from mcore_rl.io.host import process_exists
from mcore_rl.io.signals import signals_deferred

MARKER_FILE = ".mcore_rl-output.json"
_AUX_NAME = re.compile(r"^\.[^/]*\.mcore_rl-(staging|old)-(\d+)-([0-9a-f]{8})$")
_NAME_MAX = 255


def _real(path: str) -> str:
    """Absolute path with every symlink of its parents resolved (the last component kept as named)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _is_within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies inside it (both real absolute paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _protected(real: str) -> str | None:
    """Why ``real`` may never be an output folder, or None."""
    if real == os.sep or os.path.dirname(real) == real:
        return "is the filesystem root"
    for what, place in (
        ("the current directory", os.getcwd()),
        ("your home folder", os.path.expanduser("~")),
    ):
        place = os.path.realpath(place)
        if _is_within(place, real):
            return f"is {what}" if place == real else f"contains {what} ({place})"
    return None


def _relation_to_input(real: str, given_input: str) -> str | None:
    source = os.path.realpath(given_input)
    if real == source:
        return f"is the input {given_input}"
    if _is_within(real, source):
        return f"is inside the input {given_input}"
    if _is_within(source, real):
        return f"contains the input {given_input}"
    return None


def _allowed_place(given: str, flag: str, inputs: Sequence[str | None], what_to_give: str) -> str:
    """The real path of ``given`` unless it is empty, protected, or tied to an input (one line naming ``flag``)."""
    if not given or not given.strip():
        raise OutputError(f"{flag} is empty (an unset shell variable?); {what_to_give}")
    real = _real(given)
    reason = _protected(real) or next(
        (r for s in inputs if s and (r := _relation_to_input(real, s)) is not None), None
    )
    if reason is not None:
        raise OutputError(f"{flag} {given} {reason}; choose another folder")
    return real


def _read_marker(folder: str) -> dict[str, Any] | None:
    """Our marker in ``folder`` (a regular file, not a link), or None."""
    path = os.path.join(folder, MARKER_FILE)
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return None
        with open(path) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("tool") == "mcore_rl" else None


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder`` (data on disk before the rename that publishes it)."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    return (st.st_dev, st.st_ino)


@dataclass
class OutputFolder:
    """An output folder checked by :meth:`plan`, written under :attr:`staging`, published by :meth:`commit`."""

    path: str
    """Real absolute path of the folder to create or replace."""
    given: str
    """The path as the user gave it (for messages)."""
    flag: str
    """The flag or argument that named it (for messages), e.g. ``--out``."""
    kind: str
    """What is written ('hf-model', 'checkpoint', ...), recorded in the marker."""
    replaces: tuple[int, int] | None
    """(device, inode) of the existing folder this one replaces, None when there is none."""
    staging: str | None = None
    """The staging folder, once :meth:`begin` created it."""
    overwrite: bool = False
    """:meth:`plan`'s ``overwrite``, for the folder :meth:`begin` may put back."""
    replace_ours: bool = False
    """:meth:`plan`'s ``replace_ours``, likewise."""

    @classmethod
    def plan(
        cls,
        given: str,
        *,
        flag: str = "--out",
        inputs: Sequence[str | None] = (),
        overwrite: bool = False,
        replace_ours: bool = False,
        kind: str = "output",
    ) -> OutputFolder:
        """Check ``given`` against the rules of the module docstring; nothing is written."""
        real = _allowed_place(given, flag, inputs, "give the folder to create")
        parent, name = os.path.split(real)
        if not os.path.isdir(parent):
            raise OutputError(f"{flag} {given}: parent folder {parent} does not exist")
        if len(os.fsencode(name)) > _NAME_MAX:
            raise OutputError(f"{flag} {given}: the name is longer than {_NAME_MAX} bytes")
        replaces = cls._check_existing(real, given, flag, overwrite, replace_ours)
        return cls(real, given, flag, kind, replaces, overwrite=overwrite, replace_ours=replace_ours)

    @staticmethod
    def _check_existing(
        real: str, given: str, flag: str, overwrite: bool, replace_ours: bool
    ) -> tuple[int, int] | None:
        if not os.path.lexists(real):
            return None
        if os.path.islink(real):
            raise OutputError(f"{flag} {given} is a symbolic link; give the folder it points to, or another")
        if not os.path.isdir(real):
            raise OutputError(f"{flag} {given} exists and is not a folder; it is left as it is")
        try:
            empty = not os.listdir(real)
        except OSError as err:
            raise OutputError(f"{flag} {given}: cannot list it ({err.strerror})") from None
        if not empty and not overwrite:
            if not replace_ours:
                raise OutputError(f"{flag} {given} exists and is not empty; pass --overwrite to replace it")
            if _read_marker(real) is None:
                raise OutputError(
                    f"{flag} {given} exists and was not written by mcore_rl (no {MARKER_FILE}); "
                    "move it away or choose another folder"
                )
        return _identity(real)

    # --- writing ----------------------------------------------------------------------------------------
    def _aux_name(self, role: str, token: str) -> str:
        """``.<name>.mcore_rl-<role>-<pid>-<token>``, the name shortened to fit the filesystem's limit."""
        suffix = f".mcore_rl-{role}-{os.getpid()}-{token}"
        name = os.fsencode(os.path.basename(self.path))[: _NAME_MAX - 1 - len(suffix)]
        return os.path.join(os.path.dirname(self.path), f".{os.fsdecode(name)}{suffix}")

    def _write_marker(self, folder: str, **fields: Any) -> None:
        marker = {
            "tool": "mcore_rl",
            "kind": self.kind,
            "target": self.path,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            **fields,
        }
        with open(os.path.join(folder, MARKER_FILE), "w") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
            f.write("\n")

    def begin(self) -> str:
        """Clean stale staging of ours, then create this process's staging folder exclusively; returns it."""
        absent = not os.path.lexists(self.path)
        self.clean_stale()
        if absent and os.path.lexists(
            self.path
        ):  # a killed commit's previous output, put back: what we replace
            self.replaces = self._check_existing(
                self.path, self.given, self.flag, self.overwrite, self.replace_ours
            )
        staging = self._aux_name("staging", secrets.token_hex(4))
        os.mkdir(staging, 0o755)  # fails if anything has that name: never reuses a folder
        self.staging = staging
        self._write_marker(staging, state="staging")
        return staging

    def commit(self) -> None:
        """Publish the staging folder at :attr:`path`: fsync, then rename, without a window in which a
        concurrent writer's output or a user's folder could be replaced unseen."""
        if self.staging is None:
            raise RuntimeError("commit() before begin()")
        old = self._aux_name("old", secrets.token_hex(4)) if self.replaces is not None else None
        self._write_marker(self.staging, state="complete", replaced=old and os.path.basename(old))
        fsync_tree(self.staging)
        with signals_deferred():  # the renames below must not be split by a signal
            if old is not None:
                self._move_aside(old)
            try:
                os.rename(self.staging, self.path)  # a directory never replaces a non-empty one
            except OSError as err:
                if old is not None and not os.path.lexists(self.path):
                    os.rename(old, self.path)
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(
                        f"{self.flag} {self.given} was created by another process while this one ran; "
                        "it is left as it is (run again with --overwrite to replace it)"
                    ) from None
                raise
            self.staging = None
            fsync_dir(os.path.dirname(self.path))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _move_aside(self, old: str) -> None:
        """The folder being replaced goes to ``old``; refused if it is no longer the one :meth:`plan` saw."""
        current = _identity(self.path) if os.path.lexists(self.path) else None
        if current is None:
            return  # removed meanwhile: nothing to replace
        if current != self.replaces or os.path.islink(self.path):
            raise OutputError(
                f"{self.flag} {self.given} was replaced by another process while this one ran; "
                "it is left as it is"
            )
        os.rename(self.path, old)

    def abort(self) -> None:
        """Remove this process's staging folder (only it); safe to call more than once."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    # --- leftovers of killed runs ------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Remove staging folders of ours for this target whose process is gone; put back a previous output
        that a killed process had moved aside. Each action prints one note."""
        parent = os.path.dirname(self.path)
        for entry in sorted(os.listdir(parent)):
            match = _AUX_NAME.match(entry)
            if match is None:
                continue
            folder = os.path.join(parent, entry)
            if match.group(1) == "staging":
                self._clean_stale_staging(folder)
            else:
                self._clean_stale_old(folder, entry)

    def _is_stale(self, marker: dict[str, Any] | None) -> bool:
        return (
            marker is not None
            and marker.get("target") == self.path
            and marker.get("host") == socket.gethostname()
            and isinstance(marker.get("pid"), int)
            and not process_exists(marker["pid"])
        )

    def _clean_stale_staging(self, folder: str) -> None:
        marker = _read_marker(folder)
        if os.path.islink(folder) or not self._is_stale(marker):
            return
        assert marker is not None
        old_name = marker.get("replaced")
        ours = isinstance(old_name, str) and _AUX_NAME.match(old_name) is not None  # a bare name of ours
        old = os.path.join(os.path.dirname(self.path), str(old_name)) if ours else None
        if old is not None and os.path.isdir(old) and not os.path.lexists(self.path):
            os.rename(old, self.path)  # killed between the two renames of a commit
            note(f"restored {self.path} from {old}, moved aside by process {marker['pid']} that was killed")
        shutil.rmtree(folder)
        note(f"removed {folder}, a partial output left by process {marker['pid']} that was killed")

    def _clean_stale_old(self, folder: str, entry: str) -> None:
        """An ``old`` folder is ours to remove only when the committed output's marker names it."""
        marker = _read_marker(self.path) if os.path.isdir(self.path) else None
        if marker is None or marker.get("replaced") != entry or os.path.islink(folder):
            return
        if process_exists(int(marker.get("pid", 0))) and marker.get("host") == socket.gethostname():
            return  # its writer is still removing it
        shutil.rmtree(folder)
        note(f"removed {folder}, the previous output replaced by process {marker.get('pid')}")


def is_staging_folder(path: str) -> bool:
    """``path`` is named as a staging folder of :meth:`OutputFolder.begin` (decided from the name alone, so
    every rank of a collective write agrees without reading the filesystem): its owner publishes it, the
    writers only fill it."""
    match = _AUX_NAME.match(os.path.basename(os.path.normpath(path)))
    return match is not None and match.group(1) == "staging"


def interrupted_swap(path: str) -> str | None:
    """For a folder ``path`` that is missing: the previous output of ours that a process killed between the two
    renames of :meth:`OutputFolder.commit` left moved aside (``.<name>.mcore_rl-old-<pid>-<token>``), or None.
    The next write into ``path`` puts it back; a reader can point at it."""
    real = _real(path)
    parent, name = os.path.split(real)
    if os.path.lexists(real) or not os.path.isdir(parent):
        return None
    for entry in sorted(os.listdir(parent)):
        match = _AUX_NAME.match(entry)
        folder = os.path.join(parent, entry)
        if match is None or match.group(1) != "old" or os.path.islink(folder):
            continue
        marker = _read_marker(folder)
        # by its name (a run folder may have been copied or moved since: the marker's path is the old one), or
        # by the marker's target when the name was shortened to fit
        named = entry.startswith(f".{name}.mcore_rl-old-")
        if marker is not None and (named or os.path.basename(str(marker.get("target"))) == name):
            return folder
    return None


def write_failure(err: BaseException, folder: str) -> str | None:
    """Why writing into ``folder`` failed, in one line, when the filesystem refused it; None for anything else.
    An ``OSError`` names its file and reason; torch's checkpoint writer reports a failed write inside its zip
    container as ``RuntimeError: [enforce fail at inline_container.cc...]`` (the OS error is lost there), so it
    is named as a failed write, with the free space left when that is the likely cause."""
    if isinstance(err, OSError):
        names = " -> ".join(str(n) for n in (err.filename, err.filename2) if n is not None)
        reason = err.strerror or str(err)
        return f"{names}: {reason}" if names else reason
    if isinstance(err, RuntimeError) and "inline_container.cc" in str(err):
        detail = str(err).strip().splitlines()[0].split("] ", 1)[-1].strip(" .")
        return f"a write failed in torch's checkpoint writer ({detail}){_free_space(folder)}"
    return None


def _free_space(folder: str) -> str:
    """``; N MiB free on its filesystem`` when that is under 1 GiB (a full disk, the likely cause), else ''."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f"; {free >> 20} MiB free on its filesystem" if free < 1 << 30 else ""


def is_ours(folder: str) -> bool:
    """``folder`` carries our :data:`MARKER_FILE` (written by an :class:`OutputFolder` or a claimed run folder)."""
    return _read_marker(folder) is not None


def check_run_folder(given: str, *, flag: str, inputs: Sequence[str | None] = ()) -> str:
    """The refusals of :func:`claim_run_folder`, writing nothing (a run checks everything that can refuse it
    before it creates its folder); returns the real path."""
    real = _allowed_place(given, flag, inputs, "give the run folder")
    if os.path.islink(real):
        raise OutputError(f"{flag} {given} is a symbolic link; give the folder it points to, or another")
    if os.path.lexists(real) and not os.path.isdir(real):
        raise OutputError(f"{flag} {given} exists and is not a folder; it is left as it is")
    try:
        _refuse_foreign(real, given, flag)
    except OSError as err:
        raise OutputError(f"{flag} {given}: cannot read it ({err.strerror})") from None
    return real


def _refuse_foreign(real: str, given: str, flag: str) -> None:
    """A non-empty folder without our marker is not ours to write into."""
    if os.path.isdir(real) and _read_marker(real) is None and os.listdir(real):
        raise OutputError(
            f"{flag} {given} exists and was not written by mcore_rl (no {MARKER_FILE}); "
            "move it away or choose another folder"
        )


def claim_run_folder(given: str, *, flag: str, inputs: Sequence[str | None] = (), kind: str = "run") -> str:
    """Check and claim a long-lived run folder (logs, run checkpoints, the resolved config); returns its real path.

    A run folder is written over many steps, so it is not staged; what protects the user is where it may be:
    the rules of :meth:`OutputFolder.plan` (never the current directory, home, the root, an input, a folder
    inside or containing an input, a symlink or a file), and an existing non-empty folder only when it carries
    our marker (an earlier run of ours, which a resume continues). A new or empty folder gets the marker.
    """
    real = check_run_folder(given, flag=flag, inputs=inputs)
    try:
        os.makedirs(real, exist_ok=True)
        if _read_marker(real) is not None:
            return real
        _refuse_foreign(real, given, flag)  # again: another tool may have filled it since the check
        with open(os.path.join(real, MARKER_FILE), "x") as f:  # "x": never over a concurrent claim's file
            json.dump({"tool": "mcore_rl", "kind": kind, "target": real, "pid": os.getpid()}, f, indent=2)
            f.write("\n")
    except FileExistsError:
        pass  # a concurrent run claimed it first: it is ours either way
    except OSError as err:
        raise OutputError(f"{flag} {given}: cannot create it ({err.strerror})") from None
    return real
