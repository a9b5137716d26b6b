"""An output folder written whole or not at all, and never at the cost of a file the writer did not write.

The savers (:func:`nmcompile.deploy.save_pretrained`, ``nmcompile prune``) write into a staging folder
beside the target (:func:`staging`), then :func:`replace_folder` carries over what the target holds that
the new output keeps (a user's notes, an earlier save's other files) by hard link, moves the target aside,
renames the staging folder into its place and only then removes the old one: a failure at any point leaves
the target as it was. A target that is a symbolic link is written through: the link's own folder is the
one replaced, on the link's disk (:func:`resolve`). :func:`check_writable` tries the folder before any long
work, so a path that cannot be written is refused at once, and :func:`clean_stale` removes the staging
folders an interrupted run (killed, so its own cleanup never ran) left beside the target.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable

__all__ = ["resolve", "check_writable", "staging", "clean_stale", "replace_folder"]

_STAGING = ".{base}.partial-{pid}-"
_ASIDE = ".{base}.old-{pid}-"
_LEFT = re.compile(r"^\.(?P<base>.+)\.(partial|old|nmcompile)-(?:(?P<pid>\d+)-)?[^/]*$")


def resolve(out, what: str) -> str:
    """The absolute folder ``out`` names, through a symbolic link; refuses an empty path, the root, a link
    whose target is not a folder, and a path inside a file."""
    text = os.fspath(out)
    if not text.strip():
        raise ValueError(f"{what}: the output folder is an empty path; give a folder")
    if os.path.islink(text) and not os.path.isdir(text):
        raise ValueError(f"{what}: {text} is a symbolic link to {os.readlink(text)}, which is not a folder; give a "
                         "folder, or a link to one")
    real = os.path.realpath(text)
    if os.path.dirname(real) == real:
        raise ValueError(f"{what}: {text} is the root of the file system; give a folder below it")
    above = os.path.dirname(real)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"{what}: {text} would be inside {above}, which is a file; give a folder")
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"{what}: {text} is a file; give a folder")
    return real


def check_writable(target: str, what: str) -> None:
    """Raise ``OSError`` naming the folder and the reason when nothing can be written beside ``target``
    (its parent is made if missing, as the save would make it); writes and removes one empty folder."""
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=_STAGING.format(base=os.path.basename(target), pid=os.getpid())))
    except OSError as err:
        raise OSError(err.errno, f"{what}: cannot write the output beside {target} (in {parent}): "
                                 f"{err.strerror or err}; give a folder you can write") from err


def staging(target: str) -> str:
    """A new empty folder beside ``target`` for the output to be written into, with the usual permissions
    (``mkdtemp``'s 0700 would become the output's) and this process's id in its name (:func:`clean_stale`)."""
    folder = tempfile.mkdtemp(dir=os.path.dirname(target),
                              prefix=_STAGING.format(base=os.path.basename(target), pid=os.getpid()))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(target: str, what: str) -> list[str]:
    """Remove the staging and set-aside folders of ``target`` that a run no longer alive left beside it
    (its process was killed); warn naming each; the paths removed. Those of a live process stay."""
    parent, base = os.path.dirname(target), os.path.basename(target)
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        found = _LEFT.match(name)
        path = os.path.join(parent, name)
        if not found or found.group("base") != base or not os.path.isdir(path) or os.path.islink(path):
            continue
        pid = found.group("pid")
        if pid is not None and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        warnings.warn(f"{what}: removed {', '.join(removed)}, left beside {target} by an interrupted run", stacklevel=3)
    return removed


def _carry(source: str, dest: str) -> None:
    """``source`` (a file, a link or a folder) to ``dest``, by hard link where the file system allows."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), dest)
    elif os.path.isdir(source):
        shutil.copytree(source, dest, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, dest)


def _link_or_copy(source: str, dest: str) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def replace_folder(new: str, target: str, keep: Callable[[str], bool], what: str, *,
                   keep_replaced: bool = False) -> list[str]:
    """Make ``new`` (a folder beside ``target``) the folder ``target``, whole: the entries of ``target``
    that ``keep(name)`` accepts are carried into it first. An entry that ``new`` also has is the new one;
    with ``keep_replaced`` the old one is kept too, as ``NAME.before-nmcompile`` (warned). Nothing of
    ``target`` changes unless every step before the final rename succeeded; the names carried over are
    returned."""
    carried = []
    if os.path.isdir(target):
        for name in sorted(os.listdir(target)):
            if not keep(name):
                continue
            dest = os.path.join(new, name)
            if os.path.lexists(dest):
                if not keep_replaced:
                    continue
                dest = f"{dest}.before-nmcompile"
                warnings.warn(f"{what}: {os.path.join(target, name)} was not written by nmcompile and the new output "
                              f"has a file of that name; the old one is kept as {dest}", stacklevel=3)
            _carry(os.path.join(target, name), dest)
            carried.append(name)
        aside = tempfile.mkdtemp(dir=os.path.dirname(target),
                                 prefix=_ASIDE.format(base=os.path.basename(target), pid=os.getpid()))
        os.rmdir(aside)
        os.replace(target, aside)
        try:
            os.replace(new, target)
        except BaseException:
            os.replace(aside, target)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(new, target)
    return carried
