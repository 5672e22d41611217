"""The release artifacts of `make package`, installed the way an operator would and run.

`make test-package` builds them first. The tests replace the stage_e_slots files of this
machine's PostgreSQL 15 and 18 (`make install` put them there), so they set those aside first
and put them back, byte for byte, when they end, pass or fail. Run them under
`flock /tmp/stage_e_install.lock` when other tests may be using those installations.
"""

from __future__ import annotations

import filecmp
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from pgcluster import Cluster  # noqa: E402

EXT = "stage_e_slots"
KEY = 20260725  # the default stage_e_slots.lock_key: slot s is the advisory lock (KEY, s)
ARCH = "amd64"
DIST = REPO / "dist"
_CARGO = tomllib.loads((REPO / "Cargo.toml").read_text())["package"]
VERSION = _CARGO["version"]
DESCRIPTION = _CARGO["description"]
DEB_PACKAGE = "postgresql-15-stage-e-slots"


@pytest.fixture(autouse=True)
def as_root():
    """Installing into PostgreSQL's directories and running dpkg needs root: say so, loudly."""
    assert os.geteuid() == 0, "make test-package installs packages: run it as root"


def run(*args, **kw) -> str:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def pg_config(major: str) -> str:
    return run(REPO / "scripts" / "pg-config.sh", major).strip()


def pg_dirs(config: str) -> tuple[Path, Path]:
    """(pkglibdir, sharedir/extension) of the PostgreSQL that `config` belongs to."""
    return (Path(run(config, "--pkglibdir").strip()),
            Path(run(config, "--sharedir").strip()) / "extension")


def ext_files() -> set[str]:
    """Scripts every artifact must ship: the install script pgrx generates for this version,
    plus every script in sql/ (frozen base scripts of earlier versions, upgrade scripts)."""
    return {f"{EXT}.control", f"{EXT}--{VERSION}.sql",
            *(p.name for p in (REPO / "sql").glob(f"{EXT}--*.sql"))}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ours(pkglibdir: Path, extdir: Path) -> list[Path]:
    return sorted(p for d in (pkglibdir, extdir) for p in d.glob(f"{EXT}*") if p.is_file())


@contextmanager
def installed_files_set_aside(config: str):
    """Copies the installed stage_e_slots files of that PostgreSQL away and deletes them;
    at the end deletes whatever is there instead and puts the copies back (new inodes, so a
    server that has the old library mapped is not disturbed), then checks they are identical."""
    pkglibdir, extdir = pg_dirs(config)
    backup = Path(tempfile.mkdtemp(prefix="stage_e_pkg_backup-"))
    saved = []
    for i, path in enumerate(ours(pkglibdir, extdir)):
        copy = backup / f"{i}-{path.name}"
        shutil.copy2(path, copy)
        saved.append((path, copy, path.stat(), sha256(path)))
    try:
        for path, *_ in saved:
            path.unlink()
        assert ours(pkglibdir, extdir) == []
        yield pkglibdir, extdir
    finally:
        for path in ours(pkglibdir, extdir):
            path.unlink()
        for path, copy, st, _ in saved:
            tmp = path.with_name(f".{path.name}.restore")
            shutil.copy2(copy, tmp)
            os.chown(tmp, st.st_uid, st.st_gid)
            os.chmod(tmp, st.st_mode & 0o7777)
            os.replace(tmp, path)
        restored = {p: sha256(p) for p in ours(pkglibdir, extdir)}
        assert restored == {p: digest for p, _, _, digest in saved}, \
            f"stage_e_slots files not restored; the originals are in {backup}"
        shutil.rmtree(backup)


def run_extension(config: str, name: str, library: Path) -> None:
    """A fresh preloaded cluster of that PostgreSQL: the installed library is the one the
    postmaster loaded, CREATE EXTENSION gives this version, and slots are advisory locks."""
    major = run(config, "--version").split()[1].split(".")[0]
    cluster = Cluster(name, pg_config=config)
    try:
        cluster.init()
        try:
            cluster.start()
        except subprocess.CalledProcessError as e:
            raise AssertionError(f"server did not start: {e.stderr}\n{cluster.log_text()}")
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
        assert str(library) in Path(f"/proc/{postmaster}/maps").read_text()
        with cluster.connect() as a, cluster.connect() as b:
            assert a.execute("SHOW server_version_num").fetchone()[0][:2] == major
            a.execute(f"CREATE EXTENSION {EXT}")
            assert a.execute("SELECT extversion FROM pg_extension WHERE extname = %s",
                             (EXT,)).fetchone() == (VERSION,)
            # Every version shipped is known to the server and can be updated to this one.
            versions = {r[0] for r in a.execute(
                "SELECT version FROM pg_available_extension_versions WHERE name = %s", (EXT,))}
            assert versions >= {f.removeprefix(f"{EXT}--").removesuffix(".sql")
                                for f in ext_files() if f.endswith(".sql") and f.count("--") == 1}
            assert a.execute(
                "SELECT source FROM pg_extension_update_paths(%s) WHERE target = %s "
                "AND source <> target AND path IS NULL", (EXT, VERSION)).fetchall() == []

            locks = ("SELECT objid::int, pid FROM pg_locks WHERE locktype = 'advisory' "
                     "AND classid = %s AND objsubid = 2 AND granted AND database = "
                     "(SELECT oid FROM pg_database WHERE datname = current_database()) "
                     "ORDER BY objid")
            assert a.execute("SELECT stage_e_try_slot(2)").fetchone() == (0,)
            assert a.execute(locks, (KEY,)).fetchall() == [(0, a.info.backend_pid)]
            assert b.execute("SELECT stage_e_try_slot(2)").fetchone() == (1,)
            assert a.execute(locks, (KEY,)).fetchall() == [(0, a.info.backend_pid),
                                                          (1, b.info.backend_pid)]
            assert a.execute("SELECT stage_e_release(0)").fetchone() == (True,)
            assert a.execute(locks, (KEY,)).fetchall() == [(1, b.info.backend_pid)]
    finally:
        cluster.destroy()


def deb_status() -> str:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", DEB_PACKAGE],
                       capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else "unknown"


def test_deb_installs_runs_and_removes(tmp_path):
    deb = DIST / f"{DEB_PACKAGE}_{VERSION}_{ARCH}.deb"
    assert deb.is_file(), f"{deb} missing: run make package"
    assert "ok installed" not in deb_status(), \
        f"{DEB_PACKAGE} is installed on this machine already; remove it first"

    # Metadata.
    info = run("dpkg-deb", "-I", deb)
    fields = {k: run("dpkg-deb", "-f", deb, k).rstrip("\n") for k in (
        "Package", "Version", "Architecture", "Maintainer", "Depends", "Section", "Priority",
        "Installed-Size", "Description")}
    assert fields["Package"] == DEB_PACKAGE
    assert fields["Version"] == VERSION
    assert fields["Architecture"] == ARCH
    assert "<" in fields["Maintainer"] and fields["Maintainer"].endswith(">")
    depends = [d.split()[0] for d in fields["Depends"].split(",")]
    assert "postgresql-15" in depends and "libc6" in depends, fields["Depends"]
    assert (fields["Section"], fields["Priority"]) == ("database", "optional")
    assert int(fields["Installed-Size"]) > 0
    synopsis, _, long = fields["Description"].partition("\n")
    assert synopsis.strip() and len(synopsis) <= 80
    assert " ".join(DESCRIPTION.split()) in " ".join(long.split())
    assert " md5sums" in info and " control" in info

    # Contents: exactly these files, root-owned, 0644 (directories 0755), and an md5sums
    # entry for each.
    lib = Path("/usr/lib/postgresql/15/lib") / f"{EXT}.so"
    extdir = Path("/usr/share/postgresql/15/extension")
    doc = Path("/usr/share/doc") / DEB_PACKAGE
    expected = {lib, doc / "copyright", doc / "changelog.Debian.gz",
                *(extdir / f for f in ext_files())}
    expected_dirs = {d for f in expected for d in f.parents}
    listing = [line.split(None, 5) for line in run("dpkg-deb", "-c", deb).splitlines()]
    assert {"/" + e[5].removeprefix("./").rstrip("/") for e in listing} == \
        {str(p) for p in expected | expected_dirs}
    for mode, owner, *_, name in listing:
        assert owner == "root/root", (name, owner)
        assert mode == ("drwxr-xr-x" if name.endswith("/") else "-rw-r--r--"), (name, mode)
    run("dpkg-deb", "-e", deb, tmp_path / "DEBIAN")
    md5sums = (tmp_path / "DEBIAN" / "md5sums").read_text().splitlines()
    assert {"/" + line.split(None, 1)[1] for line in md5sums} == {str(p) for p in expected}

    # Installed on this machine, it is what dpkg says, and it works.
    with installed_files_set_aside(pg_config("15")) as (pkglibdir, ext):
        assert (pkglibdir, ext) == (lib.parent, extdir)
        try:
            run("dpkg", "-i", deb)
            assert deb_status() == "install ok installed"
            listed = [Path(p) for p in run("dpkg", "-L", DEB_PACKAGE).splitlines()]
            assert {p for p in listed if not p.is_dir()} == expected
            assert {p for p in listed if p.is_dir()} == expected_dirs
            assert all(p.is_file() for p in expected)
            run("dpkg", "--verify", DEB_PACKAGE)  # every file matches its md5sum
            run_extension(pg_config("15"), "package-deb15", lib)

            run("dpkg", "-r", DEB_PACKAGE)
            assert "ok installed" not in deb_status()
            assert [p for p in expected if p.exists()] == []
            assert ours(pkglibdir, ext) == []
        finally:
            if deb_status() != "unknown" and "not-installed" not in deb_status():
                subprocess.run(["dpkg", "--purge", DEB_PACKAGE], capture_output=True)


@pytest.mark.parametrize("major", ["18", "15"])
def test_tarball_installs_with_its_own_commands(major, tmp_path):
    config = pg_config(major)
    top = f"{EXT}-{VERSION}-pg{major}-{ARCH}"
    tgz = DIST / f"{top}.tar.gz"
    assert tgz.is_file(), f"{tgz} missing: run make package PG={major}"

    with tarfile.open(tgz) as t:
        members = t.getmembers()
        install_text = t.extractfile(f"{top}/INSTALL").read().decode()
    assert {m.name for m in members if m.isfile()} == {
        f"{top}/INSTALL", f"{top}/lib/{EXT}.so", *(f"{top}/share/extension/{f}"
                                                    for f in ext_files())}
    assert all(m.isfile() or m.isdir() for m in members)
    assert all(m.name == top or m.name.startswith(top + "/") for m in members)
    assert all((m.uid, m.gid) == (0, 0) for m in members)

    # INSTALL names this major and the steps; its copy commands are what we run below.
    assert f"for PostgreSQL {major} " in install_text
    assert f"shared_preload_libraries = '{EXT}'" in install_text
    assert f"CREATE EXTENSION {EXT};" in install_text
    commands = [line.strip() for line in install_text.splitlines()
                if line.strip().startswith(("install ", "cp "))]
    assert len(commands) == 2, commands
    assert '"$(pg_config --pkglibdir)/"' in commands[0]
    assert '"$(pg_config --sharedir)/extension/"' in commands[1]

    run("tar", "-xzf", tgz, "-C", tmp_path)
    unpacked = tmp_path / top
    env = {**os.environ, "PATH": f"{Path(config).parent}:{os.environ['PATH']}"}
    with installed_files_set_aside(config) as (pkglibdir, extdir):
        for command in commands:
            run("bash", "-c", command, cwd=unpacked, env=env)
        installed = ours(pkglibdir, extdir)
        assert installed == sorted([pkglibdir / f"{EXT}.so", *(extdir / f for f in ext_files())])
        assert filecmp.cmp(unpacked / "lib" / f"{EXT}.so", pkglibdir / f"{EXT}.so", shallow=False)
        for f in ext_files():
            assert filecmp.cmp(unpacked / "share" / "extension" / f, extdir / f, shallow=False)
        run_extension(config, f"package-tar{major}", pkglibdir / f"{EXT}.so")

        for path in installed:
            path.unlink()
        assert ours(pkglibdir, extdir) == []


def test_python_wheel_and_sdist(tmp_path):
    """`make package` also builds the Python package: a wheel and an sdist named for this
    version (the package's __version__ is the extension's), the wheel carrying the type marker
    and the Django app's migrations and management command, installable into a fresh venv
    where it imports at that version without the source tree."""
    wheel = DIST / f"stage_e_slots-{VERSION}-py3-none-any.whl"
    sdist = DIST / f"stage_e_slots-{VERSION}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in DIST.iterdir())
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"stage_e_slots-{VERSION}.dist-info/METADATA").decode()
    for member in ("stage_e_slots/__init__.py", "stage_e_slots/py.typed", "stage_e_slots/aio.py",
                   "stage_e_slots/django/apps.py",
                   "stage_e_slots/django/migrations/__init__.py",
                   "stage_e_slots/django/management/commands/stage_e_status.py"):
        assert member in names, member
    assert "Name: stage-e-slots" in meta and f"Version: {VERSION}" in meta
    assert "Requires-Dist: psycopg" in meta and "Provides-Extra: django" in meta
    with tarfile.open(sdist) as t:
        assert f"stage_e_slots-{VERSION}/pyproject.toml" in t.getnames()
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    run(str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
        str(wheel))
    out = run(str(venv / "bin" / "python"), "-c",
              "import stage_e_slots, stage_e_slots.aio; "
              "print(stage_e_slots.__version__, stage_e_slots.__file__)", cwd=str(tmp_path))
    version, path = out.split()
    assert version == VERSION and str(venv) in path
