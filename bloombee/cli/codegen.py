"""`bloombee-codegen`: render every <family>.yaml spec into a <family>/ package (default: the specs/ folder shipped
with bloombee, the repository's specs/ in a checkout, into bloombee/models)."""

import sys
from pathlib import Path

from bloombee.cli.common import ArgumentParser, add_common_flags, parse_args, setup_logging


def main(argv=None) -> None:
    parser = ArgumentParser(prog="bloombee-codegen", description=__doc__)
    parser.add_argument("--specs", type=Path, help="folder of <family>.yaml specs (default: the repository's specs/, "
                        "shipped as bloombee/models/specs)")
    parser.add_argument("--templates", type=Path, help="folder of *.py.j2 templates (default: the repository's "
                        "templates/, shipped as bloombee/models/templates)")
    parser.add_argument("--out", type=Path, help="folder receiving one package per family (default: the installed "
                        "bloombee/models)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if any generated file differs from a fresh render")
    add_common_flags(parser, default_level="warning")
    args = parse_args(parser, argv)
    setup_logging(args.log_level)
    from bloombee.models.codegen import MODELS_DIR, SPECS_DIR, TEMPLATES_DIR, drift, render_all, write_all
    from bloombee.models.spec import SpecError

    args.specs, args.templates, args.out = args.specs or SPECS_DIR, args.templates or TEMPLATES_DIR, args.out or MODELS_DIR
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
