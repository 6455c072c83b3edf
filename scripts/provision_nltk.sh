#!/usr/bin/env bash
# Provision the NLTK data that evaluation needs, offline: WordNet 3.0 for METEOR, and NLTK's
# trained English Punkt model (punkt_tab/english) that nltk.word_tokenize, and so METEOR's default
# tokenisation (HF evaluate's "meteor", the authors' script), splits sentences with.
#
#   bash scripts/provision_nltk.sh <NLTK_DATA dir>      (the Makefile passes .venv/nltk_data)
#
# No model/data hub is reachable here, so nltk.download() is not an option. Debian ships the
# WordNet 3.0 database in `wordnet-base` and the sense index NLTK's reader also loads
# (`index.sense`) in `wordnet-sense-index`. We fetch both with `apt-get download` (unpacking
# with `dpkg-deb -x` into a temp dir needs no root) and lay them out as NLTK's
# `corpora/wordnet/`. Debian lacks the `lexnames` file NLTK's reader opens first, so we write
# its standard content (the 45 lexicographer files, see lexnames(5WN)).
#
# Punkt: no Debian package ships NLTK's punkt_tab; the llama-index-core wheel on PyPI does
# (llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/). We `pip download --no-deps` that one
# wheel into a temp dir (or take $PUNKT_WHEEL, a copy you fetched yourself), unpack only its
# english/ folder into $NLTK_DATA/tokenizers/punkt_tab/english/, and check each file's sha256
# (the values below; they match NLTK's own punkt_tab release). The package is never installed.
#
# Sources tried in order: $WORDNET_DEBS (space-separated paths of the two .deb files you
# fetched yourself), an installed /usr/share/wordnet (apt-get install wordnet-base
# wordnet-sense-index), `apt-get download` (running `apt-get update` first when that fails and
# we are root). Idempotent: does nothing for data already provisioned (Punkt: with the right hashes).
set -euo pipefail

NLTK_DATA_DIR="${1:-.venv/nltk_data}"
WN_DIR="$NLTK_DATA_DIR/corpora/wordnet"
PACKAGES=(wordnet-base wordnet-sense-index)
REQUIRED=(data.noun data.verb data.adj data.adv index.noun index.verb index.adj index.adv
          noun.exc verb.exc adj.exc adv.exc index.sense lexnames)

die() { echo "provision_nltk: ERROR: $*" >&2; exit 1; }

have_wordnet() {  # $1: a corpora/wordnet directory
    local f
    for f in "${REQUIRED[@]}"; do [[ -s "$1/$f" ]] || return 1; done
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# The project's interpreter when there is one (pip for Punkt, NLTK for the checks).
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3 || true)"

provision_wordnet() {
    if have_wordnet "$WN_DIR"; then
        echo "provision_nltk: WordNet already present in $WN_DIR"
        return 0
    fi

    download_debs() {
        # Downloads the packages into $TMP/debs; progress goes to stderr.
        command -v apt-get >/dev/null || return 1
        mkdir -p "$TMP/debs"
        # As root, apt hands downloads to the _apt user, who cannot write into our private temp
        # dir; it falls back with a warning. Say up front that root may download.
        local opts=()
        [[ "$(id -u)" == 0 ]] && opts=(-o APT::Sandbox::User=root)
        (cd "$TMP/debs" && apt-get "${opts[@]}" download "${PACKAGES[@]}" >&2) || {
            [[ "$(id -u)" == 0 ]] || return 1
            echo "provision_nltk: apt-get download failed; running apt-get update and retrying" >&2
            apt-get update -qq >&2 || return 1
            (cd "$TMP/debs" && apt-get "${opts[@]}" download "${PACKAGES[@]}" >&2) || return 1
        }
    }

    SRC="$TMP/x/usr/share/wordnet"
    if [[ -n "${WORDNET_DEBS:-}" ]]; then
        for deb in $WORDNET_DEBS; do
            [[ -f "$deb" ]] || die "WORDNET_DEBS names $deb, which is not a file"
            dpkg-deb -x "$deb" "$TMP/x" || die "could not unpack $deb"
        done
    elif [[ -s /usr/share/wordnet/data.noun && -s /usr/share/wordnet/index.sense ]]; then
        SRC=/usr/share/wordnet
    else
        download_debs || die "could not download Debian's ${PACKAGES[*]}.
      Fix: run 'apt-get update' as root and retry; or fetch the two .deb files yourself and rerun
      with WORDNET_DEBS='/path/a.deb /path/b.deb'; or 'apt-get install ${PACKAGES[*]}'.
      On a machine with internet, 'python -m nltk.downloader -d $NLTK_DATA_DIR wordnet' also works."
        command -v dpkg-deb >/dev/null || die "dpkg-deb not found (needed to unpack the .deb files)"
        for deb in "$TMP"/debs/*.deb; do
            dpkg-deb -x "$deb" "$TMP/x" || die "could not unpack $deb"
        done
    fi
    [[ -s "$SRC/data.noun" ]] || die "no WordNet database (data.noun) found in $SRC"
    [[ -s "$SRC/index.sense" ]] || die "no index.sense found in $SRC (package wordnet-sense-index)"

    # Stage and check in a temp NLTK_DATA, then move into place, so a failed or interrupted run
    # never leaves a directory that a later run would take as "already present".
    STAGE_ROOT="$TMP/nltk_data"
    STAGE="$STAGE_ROOT/corpora/wordnet"
    mkdir -p "$STAGE"
    cp "$SRC"/* "$STAGE"/

    # lexnames: "<2-digit number>\t<lexicographer file>\t<syntactic category>" with categories
    # 1 noun, 2 verb, 3 adjective, 4 adverb. NLTK asserts that line i carries number i.
    i=0
    {
        for name in adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact \
            noun.attribute noun.body noun.cognition noun.communication noun.event noun.feeling \
            noun.food noun.group noun.location noun.motive noun.object noun.person \
            noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation \
            noun.shape noun.state noun.substance noun.time verb.body verb.change verb.cognition \
            verb.communication verb.competition verb.consumption verb.contact verb.creation \
            verb.emotion verb.motion verb.perception verb.possession verb.social verb.stative \
            verb.weather adj.ppl; do
            case "$name" in
                noun.*) cat=1 ;; verb.*) cat=2 ;; adj.*) cat=3 ;; adv.*) cat=4 ;;
            esac
            printf '%02d\t%s\t%d\n' "$i" "$name" "$cat"
            i=$((i + 1))
        done
    } > "$STAGE/lexnames"
    [[ "$i" == 45 ]] || die "internal error: wrote $i lexnames, expected 45"

    have_wordnet "$STAGE" || die "WordNet files missing after unpacking (looked for ${REQUIRED[*]})"

    # Check that NLTK can really read it.
    if [[ -n "$PY" ]] && "$PY" -c "import nltk" 2>/dev/null; then
        NLTK_DATA="$STAGE_ROOT" "$PY" -W ignore -c "
from nltk.corpus import wordnet as wn
assert wn.synsets('dog'), 'WordNet loaded but found no synsets for dog'
" || die "NLTK cannot read the WordNet unpacked from Debian's packages"
    fi

    mkdir -p "$NLTK_DATA_DIR/corpora"
    rm -rf "$WN_DIR"
    mv "$STAGE" "$WN_DIR"
    echo "provision_nltk: WordNet provisioned in $WN_DIR"
}


# ---------------------------------------------------------------- Punkt (punkt_tab/english)
PUNKT_DIR="$NLTK_DATA_DIR/tokenizers/punkt_tab/english"
PUNKT_PACKAGE="llama-index-core==0.14.25"
PUNKT_IN_WHEEL="llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/english"
# sha256 of NLTK's trained English Punkt parameters (punkt_tab), file by file.
PUNKT_SHA256="92a3e070f43d9b4c5534758ca40ad7343b04e7e29bfe0c2eb658a39445a4f779  abbrev_types.txt
8e2da1225e4dd2cc9dba261ee231ccb134859e21b46006e7f472c5ee269af0cf  collocations.tab
4bbcca25ed3d3f06c02402abf8419b9f033b8adc06e7b482eca4e45f81a5dc4c  ortho_context.tab
f3f8535483e1dba487241b764945168123bca3209a9645e59acd1225dc76edac  sent_starters.txt"

punkt_ok() {  # $1: a punkt_tab/english directory; checks every file's hash
    [[ -d "$1" ]] && (cd "$1" && sha256sum --quiet --check --status - <<<"$PUNKT_SHA256") 2>/dev/null
}

provision_punkt() {
    if punkt_ok "$PUNKT_DIR"; then
        echo "provision_nltk: Punkt (punkt_tab/english) already present in $PUNKT_DIR"
        return 0
    fi
    [[ -n "$PY" ]] || die "no python found to unpack the Punkt data (set PYTHON=<interpreter>)"
    local wheel="${PUNKT_WHEEL:-}"
    if [[ -z "$wheel" ]]; then
        mkdir -p "$TMP/wheel"
        "$PY" -m pip download -q --no-deps --only-binary :all: -d "$TMP/wheel" "$PUNKT_PACKAGE" >&2 \
            || die "could not download $PUNKT_PACKAGE (it ships NLTK's Punkt data) from the package index.
  Fix: fetch that wheel yourself ('pip download --no-deps $PUNKT_PACKAGE') and rerun with
  PUNKT_WHEEL=/path/to/the.whl; or, on a machine with internet,
  'python -m nltk.downloader -d $NLTK_DATA_DIR punkt_tab'."
        wheel="$(ls "$TMP"/wheel/*.whl | head -n 1)"
    fi
    [[ -f "$wheel" ]] || die "PUNKT_WHEEL names $wheel, which is not a file"
    local stage="$TMP/punkt/english"
    mkdir -p "$stage"
    # Only the english/ folder leaves the wheel; nothing is installed.
    "$PY" - "$wheel" "$PUNKT_IN_WHEEL" "$stage" <<'PYEOF' || die "could not unpack the Punkt data from $wheel"
import sys, zipfile
from pathlib import Path
wheel, inner, dest = sys.argv[1], sys.argv[2].rstrip("/") + "/", Path(sys.argv[3])
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(inner) and not n.endswith("/") and "/" not in n[len(inner):]]
    if not names:
        sys.exit(f"{wheel} has no {inner}")
    for n in names:
        (dest / n[len(inner):]).write_bytes(z.read(n))
PYEOF
    punkt_ok "$stage" || die "the Punkt files in $wheel do not have the expected sha256 (see PUNKT_SHA256 in $0)"
    if "$PY" -c "import nltk" 2>/dev/null; then
        mkdir -p "$TMP/punkt_check/tokenizers/punkt_tab"
        cp -r "$stage" "$TMP/punkt_check/tokenizers/punkt_tab/english"
        NLTK_DATA="$TMP/punkt_check" "$PY" -W ignore -c "
from nltk.tokenize import word_tokenize
got = word_tokenize('Mr. Smith arrived at 5 p.m. He left.')
assert got == ['Mr.', 'Smith', 'arrived', 'at', '5', 'p.m', '.', 'He', 'left', '.'], got
" || die "NLTK cannot use the Punkt data unpacked from $wheel"
    fi
    mkdir -p "$(dirname "$PUNKT_DIR")"
    rm -rf "$PUNKT_DIR"
    mv "$stage" "$PUNKT_DIR"
    echo "provision_nltk: Punkt (punkt_tab/english) provisioned in $PUNKT_DIR"
}

provision_wordnet
provision_punkt
