"""`bloombee-codegen`: model-family code generation."""

from bloombee.cli.not_built import exit_not_built


def main() -> None:
    exit_not_built("bloombee-codegen", "model-family code generation")
