import subprocess
import sys

import pytest

import bloombee


def test_version_is_a_string():
    assert isinstance(bloombee.__version__, str) and bloombee.__version__.count(".") == 2
