"""The README's environment-variable table is generated from the settings module."""

from pathlib import Path

from torchtpu.config import env_table


def test_readme_env_table_matches_settings():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert env_table() in readme, "regenerate the README table with `torchtpu info --env`"
