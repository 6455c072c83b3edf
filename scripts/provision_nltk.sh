#!/usr/bin/env bash
# Provision the NLTK data that evaluation needs, offline: WordNet 3.0 for METEOR.
#
#   bash scripts/provision_nltk.sh <NLTK_DATA dir>      (the Makefile passes .venv/nltk_data)
#
# No model/data hub is reachable here, so nltk.download() is not an option. Debian ships the
# WordNet 3.0 database in `wordnet-base` and the sense index NLTK's reader also loads
# (`index.sense`) in `wordnet-sense-index`. We fetch both with `apt-get download` (unpacking
# with `dpkg-deb -x` into a temp dir needs no root) and lay them out as NLTK's
# `corpora/wordnet/`. Debian lacks the `lexnames` file NLTK's reader opens first, so we write
# its standard content (the 45 lexicographer files, see lexnames(5WN)).
# No tokenizer data (punkt) is provisioned: rolemrc's METEOR tokenises without it
# (see rolemrc/eval/metrics.py).
#
# Sources tried in order: $WORDNET_DEBS (space-separated paths of the two .deb files you
# fetched yourself), an installed /usr/share/wordnet (apt-get install wordnet-base
# wordnet-sense-index), `apt-get download` (running `apt-get update` first when that fails and
# we are root). Idempotent: does nothing if WordNet is already provisioned.
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

if have_wordnet "$WN_DIR"; then
    echo "provision_nltk: WordNet already present in $WN_DIR"
    exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

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

# Check that NLTK can really read it, with the project's interpreter when there is one.
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3 || true)"
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
