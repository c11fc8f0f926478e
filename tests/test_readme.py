"""The README's two set-up commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    blocks, inside, cur = [], False, []
    for line in text.splitlines():
        if line.startswith("```bash"):
            inside, cur = True, []
        elif line.startswith("```") and inside:
            inside = False
            blocks.append("\n".join(cur).strip())
        elif inside:
            cur.append(line)
    return blocks


def test_ci_runs_the_readme_test_command():
    readme_blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_cmd = readme_blocks[1]
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci


def test_main_job_command_installs_torch_first_and_runs_an_embedded_recipe():
    main_cmd = _bash_blocks((ROOT / "README.md").read_text())[0]
    assert main_cmd.startswith("pip install torch==2.13.0 && pip install -e .")
    recipe = main_cmd.split("--recipe ")[1].split()[0]
    assert (ROOT / "recipes" / f"{recipe}.yaml").is_file()
