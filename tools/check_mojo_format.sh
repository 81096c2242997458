#!/usr/bin/env bash
# Fails, naming the files, when a .mojo file under mojo/ is not as `mojo format`
# writes it. Mojo 1.2's `mojo format` has no check mode, so this formats a copy
# of the tree and compares. `--fix` formats the tree in place instead.
# MOJO names the compiler (default: the checkout's .venv/bin/mojo).
set -euo pipefail
cd "$(dirname "$0")/.."

MOJO=${MOJO:-.venv/bin/mojo}
FORMAT=(format --quiet --line-length 100)

if [[ "${1:-}" == "--fix" ]]; then
    set +e
    "$MOJO" "${FORMAT[@]}" mojo 2>&1 | grep -v Crashpad
    exit "${PIPESTATUS[0]}"
fi

copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp -R mojo "$copy/"
"$MOJO" "${FORMAT[@]}" "$copy/mojo" >/dev/null 2>"$copy/format.log" || {
    cat "$copy/format.log" >&2
    echo "mojo format failed" >&2
    exit 2
}

unformatted=()
while IFS= read -r -d '' file; do
    cmp -s "$file" "$copy/$file" || unformatted+=("$file")
done < <(find mojo -name '*.mojo' -print0 | sort -z)

if ((${#unformatted[@]})); then
    echo "Mojo files not formatted (fix with tools/check_mojo_format.sh --fix):" >&2
    printf '  %s\n' "${unformatted[@]}" >&2
    exit 1
fi
echo "all $(find mojo -name '*.mojo' | wc -l) Mojo files formatted"
