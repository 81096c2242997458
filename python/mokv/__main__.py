"""`python -m mokv`: what is installed and where (`mokv.about.report`); with arguments, the
`mokv` command. `main` is the `mokv` command's entry point."""

from __future__ import annotations

import sys

from mokv.about import report


def main() -> None:
    """The `mokv` command: the click CLI in `mokv_examples`, whose dependencies are mokv's
    `cli` extra. Without them `mokv --version` still prints the report, and any other
    command says which extra to install instead of failing on an import."""
    try:
        from mokv_examples.cli import main as cli
    except ModuleNotFoundError as missing:
        if sys.argv[1:] == ["--version"]:
            print(report())
            return
        sys.exit(f"mokv: the mokv command needs mokv's cli extra: pip install 'mokv[cli]' ({missing})")
    cli()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main()
    else:
        print(report())
