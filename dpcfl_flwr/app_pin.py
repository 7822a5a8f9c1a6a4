"""Which app code a deployed silo runs: the ``dpcfl_flwr`` package its operator installed.

The FAB (Flower's app bundle) comes from the server, which a silo does not trust
(docs/threat-model.md): a FAB whose ``client_app.py`` skipped the ledger would spend the silo's
privacy without a trace. So a silo pins its app to the package installed on it, read once when
its process starts, and accepts a FAB only if running that FAB could run nothing else:

1. its files are Flower's hash list ``.info/CONTENT``, ``pyproject.toml`` and the installed
   package's ``.py`` files, each under its canonical name and once: no extra or missing module,
   and no file of any other kind (a ``.so`` or ``.pyc`` next to a module, a ``.pth``, a
   top-level package that would shadow ``torch`` on the app's ``sys.path``, data it might read);
2. every one of those ``.py`` files is byte-identical to the installed one;
3. its ``pyproject.toml`` loads :data:`CLIENTAPP` (the component Flower's ``flwr-clientapp``
   imports) and names the app the run says it is (Flower finds the installed app by that name).

Its other contents, the run config defaults and dependencies, are data the silo never obeys:
the app validates run config, and runtime dependency installation stays off. What is checked
is the code, not the FAB's hash: a FAB built from the same code with other run-config defaults
is the same app, and a hash pin would add no code the silo had not already installed.
"""

from __future__ import annotations

import hashlib
import io
import tomllib
import zipfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

import dpcfl_flwr

CLIENTAPP = "dpcfl_flwr.client_app:app"
FAB_HASHES = ".info/CONTENT"  # Flower's list of the FAB's files and their SHA-256
FAB_CONFIG = "pyproject.toml"
MAX_METADATA_BYTES = 1 << 20  # pyproject.toml, .info/CONTENT: read before anything runs


def installed_sources(package: Path) -> dict[str, bytes]:
    """``package``'s ``.py`` files by their FAB name (``dpcfl_flwr/...``)."""
    root = package.parent
    return {path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(package.rglob("*.py"))}


# Read when the silo's process starts, before its ClientApp modules are imported: the code the
# operator installed and this process runs.
PACKAGE = Path(dpcfl_flwr.__file__).parent
INSTALLED = installed_sources(PACKAGE)


def fab_hash(fab: bytes) -> str:
    """The FAB's SHA-256 (Flower's name for a FAB's content)."""
    return hashlib.sha256(fab).hexdigest()


def refusal(fab: bytes, fab_id: str | None = None, fab_version: str | None = None,
            sources: Mapping[str, bytes] = INSTALLED) -> str | None:
    """Why the FAB ``fab`` must not run on this silo, in one line; None: it ships exactly the
    installed app (see the module doc). ``fab_id`` / ``fab_version``: what the run says the
    FAB is (``publisher/name`` and version), checked when given."""
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as archive:
            return (_refused_files(archive, sources)
                    or _refused_config(archive.read(FAB_CONFIG), fab_id, fab_version))
    except Exception as exc:  # noqa: BLE001 - a FAB that cannot be read is refused, whatever broke
        return f"not a readable FAB ({type(exc).__name__}: {exc})"


def _refused_files(archive: zipfile.ZipFile, sources: Mapping[str, bytes]) -> str | None:
    names = [info.filename for info in archive.infolist()]
    for name in names:
        if str(PurePosixPath(name)) != name or name.startswith("/") or ".." in name.split("/"):
            return f"it ships a file under a non-canonical name, {name!r}"
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        return f"it ships {twice[0]} twice"
    allowed = {*sources, FAB_HASHES, FAB_CONFIG}
    for name in names:
        if name not in allowed:
            return (f"it ships {name}, which is not a module of the installed package "
                    f"(nor {FAB_CONFIG} or {FAB_HASHES})")
    for name, installed in sorted(sources.items()):
        if name not in names:
            return f"it lacks {name}, a module of the installed package"
        info = archive.getinfo(name)
        if info.file_size != len(installed) or archive.read(info) != installed:
            return f"its {name} differs from the installed one"
    for name in (FAB_CONFIG, FAB_HASHES):
        if name not in names:
            return f"it has no {name}"
        if archive.getinfo(name).file_size > MAX_METADATA_BYTES:
            return f"its {name} is larger than {MAX_METADATA_BYTES} bytes"
    return None


def _refused_config(config: bytes, fab_id: str | None, fab_version: str | None) -> str | None:
    try:
        project = tomllib.loads(config.decode())
        app = project["tool"]["flwr"]["app"]
        clientapp = app["components"]["clientapp"]
        name = f"{app['publisher']}/{project['project']['name']}"
        version = project["project"]["version"]
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        return f"its {FAB_CONFIG} is not a Flower app's ({type(exc).__name__}: {exc})"
    if clientapp != CLIENTAPP:
        return f"its ClientApp is {clientapp!r}, not {CLIENTAPP!r}"
    if fab_id is not None and (fab_id, fab_version) != (name, version):
        return (f"the run names app {fab_id} {fab_version}, the FAB is {name} {version} "
                "(Flower would load the app installed under the run's name)")
    return None
