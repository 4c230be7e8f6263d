"""`bloombee-codegen`: render every <family>.yaml spec into a <family>/ package (default: the installed
bloombee/models/specs into bloombee/models)."""

import argparse
import sys
from pathlib import Path

from bloombee.models.codegen import MODELS_DIR, SPECS_DIR, TEMPLATES_DIR, drift, render_all, write_all
from bloombee.models.spec import SpecError


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="bloombee-codegen", description=__doc__)
    parser.add_argument("--specs", type=Path, default=SPECS_DIR,
                        help=f"folder of <family>.yaml specs (default: {SPECS_DIR})")
    parser.add_argument("--templates", type=Path, default=TEMPLATES_DIR,
                        help=f"folder of *.py.j2 templates (default: {TEMPLATES_DIR})")
    parser.add_argument("--out", type=Path, default=MODELS_DIR,
                        help=f"folder receiving one package per family (default: {MODELS_DIR})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any generated file differs from a fresh render")
    args = parser.parse_args(argv)
    try:
        rendered = render_all(args.specs, args.templates)
    except (SpecError, FileNotFoundError) as e:
        print(f"bloombee-codegen: {e}", file=sys.stderr)
        sys.exit(2)
    if args.check:
        problems = drift(rendered, args.out)
        for line in problems:
            print(f"bloombee-codegen: drift: {line}", file=sys.stderr)
        if problems:
            print("bloombee-codegen: run `bloombee-codegen` to regenerate.", file=sys.stderr)
            sys.exit(1)
        print(f"bloombee-codegen: {len(rendered)} families up to date.")
        return
    written = write_all(rendered, args.out)
    print(f"bloombee-codegen: {len(rendered)} families rendered, {len(written)} files written.")


if __name__ == "__main__":
    main()
