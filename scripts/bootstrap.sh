#!/bin/sh
# Run nox from a virtualenv of its own, never from the system Python.
#
#   sh scripts/bootstrap.sh -s rehearse      # any nox arguments
#
# A distribution's python3 (Debian 12, Ubuntu 24.04) refuses `pip install` (PEP 668,
# externally-managed-environment), and a bare root shell may have no sudo. So: nox goes into
# .nox/.bootstrap (made with `python3 -m venv`; python3-venv is installed through apt when
# the distribution split it out), and the lab's root comes from being root already, or from
# sudo when it is there (SPARKDEPLOY_SUDO=no stays the calling user, e.g. for the unit tests).
# POSIX sh, nothing but python3 needed up front.
set -eu

here=$(CDPATH='' cd -- "$(dirname -- "$0")/.." && pwd)
cd "$here"

say() { printf 'bootstrap: %s\n' "$*" >&2; }
die() { say "$*"; exit 2; }

if [ "$(id -u)" != 0 ] && [ "${SPARKDEPLOY_SUDO:-yes}" != no ]; then
    if command -v sudo >/dev/null 2>&1; then
        say "not root: going on through sudo"
        exec sudo -- sh "$here/scripts/bootstrap.sh" "$@"
    fi
fi
[ "$(id -u)" = 0 ] || say "not root: going on as $(id -un) (the lab and its tests need root)"

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON on PATH (Python >= 3.11 needed)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$PYTHON is $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'); Python >= 3.11 needed"

venv=.nox/.bootstrap
nox_req='nox>=2024.4'

usable() {
    # a venv made by this python (not by one since removed or upgraded) with nox in it
    [ -x "$venv/bin/python" ] && [ -x "$venv/bin/nox" ] \
        && "$venv/bin/python" -c 'import nox' >/dev/null 2>&1 \
        && [ "$("$venv/bin/python" -c 'import sys; print(sys.version_info[:2])')" = \
             "$("$PYTHON" -c 'import sys; print(sys.version_info[:2])')" ]
}

make_venv() {
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv" >/dev/null 2>&1
}

if ! usable; then
    if ! make_venv; then
        rm -rf "$venv"
        # Debian and Ubuntu ship venv's ensurepip in a separate package.
        command -v apt-get >/dev/null 2>&1 || die "$PYTHON -m venv failed and there is no apt-get to install python3-venv"
        [ "$(id -u)" = 0 ] || die "$PYTHON -m venv failed; install python3-venv (needs root)"
        pkg=python3-venv
        ver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        say "$PYTHON -m venv failed: installing $pkg (and python$ver-venv) with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
            || apt-get install -y -qq --no-install-recommends "python$ver-venv" >/dev/null \
            || die "apt-get could not install $pkg"
        make_venv || die "$PYTHON -m venv still fails after installing $pkg"
    fi
    say "installing nox into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$nox_req" \
        || { rm -rf "$venv"; die "pip could not install $nox_req into $venv"; }
fi

exec "$venv/bin/nox" "$@"
