"""`bloombee-plan`: the pipeline planner."""

from bloombee.cli.not_built import exit_not_built


def main() -> None:
    exit_not_built("bloombee-plan", "the pipeline planner")
