#!/usr/bin/env bash
# Release artifacts that install without Rust, built with `cargo pgrx package` for the PostgreSQL
# that PG_CONFIG names, into dist/:
#   stage_e_slots-<version>-pg<major>-<arch>.tar.gz  lib/ and share/extension/ as they go under
#       `pg_config --pkglibdir` and `--sharedir`, plus an INSTALL text (any PostgreSQL <major>);
#   postgresql-<major>-stage-e-slots_<version>_<arch>.deb  only when PG_CONFIG is a Debian
#       PostgreSQL (/usr/lib/postgresql/<major>/bin/pg_config), laid out as Debian's own
#       extension packages (postgresql-15-pgvector and friends).
# Both are reproducible: timestamps come from the last commit (or SOURCE_DATE_EPOCH).
# Usage: scripts/package.sh [PG_CONFIG]   (default: $PG_CONFIG, else Debian's PostgreSQL 15)
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${1:-${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}}
EXT=stage_e_slots
DIST=dist

major=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
pkglibdir=$("$PG_CONFIG" --pkglibdir)
sharedir=$("$PG_CONFIG" --sharedir)
arch=$(dpkg --print-architecture 2>/dev/null || uname -m | sed 's/x86_64/amd64/; s/aarch64/arm64/')
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

# Version and description come from Cargo.toml (the control file's default_version is
# @CARGO_VERSION@, so the extension version is the crate version).
meta=$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null || cargo metadata --no-deps --format-version 1)
version=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["packages"][0]["version"])' <<<"$meta")
description=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["packages"][0]["description"])' <<<"$meta")
license=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["packages"][0]["license"] or "")' <<<"$meta")

# 1. Release build and `cargo pgrx package`; start from an empty output directory so that a
#    script deleted from sql/ does not linger in the artifacts.
out="${CARGO_TARGET_DIR:-target}/release/$EXT-pg$major"
rm -rf "$out"
echo "==> cargo pgrx package --pg-config $PG_CONFIG (PostgreSQL $major, $EXT $version)"
cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$out"
lib="$out$pkglibdir/$EXT.so"
extdir="$out$sharedir/extension"
[ -f "$lib" ] && [ -f "$extdir/$EXT.control" ] && [ -f "$extdir/$EXT--$version.sql" ] || {
  echo "cargo pgrx package did not write $lib and $extdir/$EXT{.control,--$version.sql}" >&2
  exit 1
}

# 2. cargo pgrx copies only upgrade scripts (sql/EXT--A--B.sql); add the frozen base scripts
#    (sql/EXT--X.sql) too, with the same @CARGO_VERSION@ substitution. The script pgrx generated
#    for the current version wins over a frozen one of the same name (it is what `make install`
#    installs); say so if they differ.
for f in sql/"$EXT"--*.sql; do
  [ -f "$f" ] || continue                    # no sql/ directory (yet): nothing to add
  dest="$extdir/$(basename "$f")"
  if [ -e "$dest" ]; then
    if [ "$(basename "$f")" = "$EXT--$version.sql" ] &&
       ! sed "s/@CARGO_VERSION@/$version/g" "$f" | cmp -s - "$dest"; then
      echo "WARNING: $f differs from the install script pgrx generated for $version; packaging the generated one" >&2
    fi
    continue
  fi
  sed "s/@CARGO_VERSION@/$version/g" "$f" >"$dest"
done

# 3. Stage: a stripped library (as dh_strip does; the dynamic symbols Postgres looks up stay),
#    every file 0644, every directory 0755, owned by root in the archives.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
umask 022
strip --strip-unneeded --remove-section=.comment --remove-section=.note -o "$stage/$EXT.so" "$lib"
chmod 0644 "$stage/$EXT.so"
mapfile -t ext_files < <(cd "$extdir" && ls -1 "$EXT.control" "$EXT"--*.sql | LC_ALL=C sort)
mkdir -p "$DIST"
touch_all() { find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +; }

# 4. The tarball, relative to pkglibdir (lib/) and sharedir (share/).
name="$EXT-$version-pg$major-$arch"
tdir="$stage/tar/$name"
install -d -m 0755 "$tdir/lib" "$tdir/share/extension"
install -m 0644 "$stage/$EXT.so" "$tdir/lib/"
for f in "${ext_files[@]}"; do install -m 0644 "$extdir/$f" "$tdir/share/extension/"; done
cat >"$tdir/INSTALL" <<EOF
$EXT $version for PostgreSQL $major ($arch, Linux with glibc), built against $("$PG_CONFIG" --version)

From this directory, with the pg_config of the server you install into first in PATH (or
spelled out in full), as a user who may write to PostgreSQL's directories (root, or sudo):

    install -m 644 lib/$EXT.so "\$(pg_config --pkglibdir)/"
    install -m 644 share/extension/$EXT* "\$(pg_config --sharedir)/extension/"

(install, unlike cp over the old file, replaces a library a running server has loaded without
corrupting it.) The library must be preloaded: in postgresql.conf

    shared_preload_libraries = '$EXT'   # add to the list if there is one

then restart the server, and in each database that uses it:

    CREATE EXTENSION $EXT;

To uninstall: DROP EXTENSION in each database, take $EXT out of shared_preload_libraries,
restart, then delete \$(pg_config --pkglibdir)/$EXT.so and
\$(pg_config --sharedir)/extension/$EXT.control and $EXT--*.sql.
EOF
chmod 0644 "$tdir/INSTALL"
touch_all "$stage/tar"
tarball="$DIST/$name.tar.gz"
tar -C "$stage/tar" --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" \
  -cf - "$name" | gzip -9n >"$tarball"

# 5. The .deb, for a Debian PostgreSQL only (its paths are the package's paths).
deb=""
if [ "$PG_CONFIG" = "/usr/lib/postgresql/$major/bin/pg_config" ] &&
   [ "$pkglibdir" = "/usr/lib/postgresql/$major/lib" ] &&
   [ "$sharedir" = "/usr/share/postgresql/$major" ] && command -v dpkg-deb >/dev/null; then
  pkg="postgresql-$major-${EXT//_/-}"
  # Maintainer: DEB_MAINTAINER, else Debian's DEBFULLNAME/DEBEMAIL, else the last commit's author.
  maintainer=${DEB_MAINTAINER:-}
  if [ -z "$maintainer" ] && [ -n "${DEBEMAIL:-}" ]; then maintainer="${DEBFULLNAME:-$EXT maintainers} <$DEBEMAIL>"; fi
  [ -n "$maintainer" ] || maintainer=$(git log -1 --format='%an <%ae>' 2>/dev/null || true)
  [ -n "$maintainer" ] || { echo "set DEB_MAINTAINER='Name <email>' (not a git checkout)" >&2; exit 1; }
  root="$stage/deb"
  doc="$root/usr/share/doc/$pkg"
  install -d -m 0755 "$root$pkglibdir" "$root$sharedir/extension" "$doc" "$root/DEBIAN"
  install -m 0644 "$stage/$EXT.so" "$root$pkglibdir/"
  for f in "${ext_files[@]}"; do install -m 0644 "$extdir/$f" "$root$sharedir/extension/"; done

  # Depends: the server, plus the shared libraries the .so needs, with the minimal versions
  # dpkg-shlibdeps finds (without dpkg-dev: libc6 at the newest GLIBC_ symbol version used).
  if command -v dpkg-shlibdeps >/dev/null; then
    mkdir -p "$stage/shlibs/debian"
    printf 'Source: %s\n\nPackage: %s\nArchitecture: any\n' "$pkg" "$pkg" >"$stage/shlibs/debian/control"
    libdeps=$(cd "$stage/shlibs" && dpkg-shlibdeps -O -e "$root$pkglibdir/$EXT.so" 2>/dev/null |
              sed -n 's/^shlibs:Depends=//p')
  else
    glibc=$(objdump -T "$root$pkglibdir/$EXT.so" | { grep -o 'GLIBC_[0-9.]*' || true; } | sed 's/GLIBC_//' | sort -V | tail -1)
    libdeps="libc6${glibc:+ (>= $glibc)}"
    needed=$(readelf -d "$root$pkglibdir/$EXT.so")
    if [[ $needed == *libgcc_s* ]]; then libdeps+=", libgcc-s1"; fi
  fi

  # /usr/share/doc: a machine-readable copyright and a Debian changelog, as policy asks.
  {
    echo "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
    echo "Upstream-Name: $EXT"
    echo "Comment: The library is built with Rust and statically links the crates of Cargo.lock"
    echo " that stage_e_slots depends on (pgrx, serde, serde_json and theirs); their"
    echo " licenses are in their sources on crates.io."
    echo
    echo "Files: *"
    echo "Copyright: $(date -u -d "@$SOURCE_DATE_EPOCH" +%Y) the $EXT authors"
    echo "License: ${license:-MIT}"
    if [ "${license:-MIT}" = MIT ]; then
      echo
      echo "License: MIT"
      sed 's/^$/./; s/^/ /' <<'EOF'
Permission is hereby granted, free of charge, to any person obtaining a copy of this software
and associated documentation files (the "Software"), to deal in the Software without
restriction, including without limitation the rights to use, copy, modify, merge, publish,
distribute, sublicense, and/or sell copies of the Software, and to permit persons to whom the
Software is furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING
BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
EOF
    fi
  } >"$doc/copyright"
  printf '%s (%s) unstable; urgency=medium\n\n  * Release %s, built with cargo pgrx package for PostgreSQL %s.\n\n -- %s  %s\n' \
    "${EXT//_/-}" "$version" "$version" "$major" "$maintainer" \
    "$(date -u -R -d "@$SOURCE_DATE_EPOCH")" | gzip -9n >"$doc/changelog.Debian.gz"
  chmod 0644 "$doc"/*

  # DEBIAN/control. Synopsis: the description up to its colon, without a leading article,
  # naming the major (Debian style: "... for PostgreSQL 15"); long text: the whole description.
  synopsis=$(sed -E 's/:.*//; s/^(A|An|The) //' <<<"$description")
  case "$synopsis" in
    *PostgreSQL) synopsis+=" $major" ;;
    *) synopsis+=" for PostgreSQL $major" ;;
  esac
  long="$description.

This package provides the $EXT extension for PostgreSQL $major. The library must be preloaded (shared_preload_libraries = '$EXT') before CREATE EXTENSION $EXT."
  # Continuation lines start with a space; an empty line is " .".
  long=$(fold -s -w 78 <<<"$long" | sed 's/ *$//; s/^$/./; s/^/ /')
  # Installed-Size as dpkg-gencontrol counts it: KiB per file, rounded up, and 1 per directory.
  installed_size=$(cd "$root" && find usr \( -type f -printf '%s\n' \) -o -printf '1024\n' |
                   awk '{ t += int(($1 + 1023) / 1024) } END { print t }')
  cat >"$root/DEBIAN/control" <<EOF
Package: $pkg
Source: ${EXT//_/-}
Version: $version
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $installed_size
Depends: postgresql-$major${libdeps:+, $libdeps}
Section: database
Priority: optional
Description: $synopsis
$long
EOF
  (cd "$root" && find usr -type f | LC_ALL=C sort | xargs md5sum) >"$root/DEBIAN/md5sums"
  chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
  touch_all "$root"
  deb="$DIST/${pkg}_${version}_$arch.deb"
  dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
fi

echo "==> artifacts for PostgreSQL $major:"
ls -l "$tarball" ${deb:+"$deb"}
