"""Audit taskloop's installed dependencies (runtime and dev) with pip-audit, and say what was checked.

pip-audit reports "No known vulnerabilities found" even when it could not look a single package up
(no route to its vulnerability service: every package is then "skipped"). This script counts what
was really audited:

- vulnerabilities in audited packages: exit 1;
- pip-audit crashed, or some packages could not be audited: exit 2, naming how many, unless
  ``--offline`` says that the vulnerability service is known to be out of reach (then a loud
  notice and exit 0: it never reads as a clean audit);
- everything audited and clean: exit 0.

    python .ci/audit.py            # the pypi service (default), or TASKLOOP_AUDIT_SERVICE=osv
    python .ci/audit.py --offline  # a machine that cannot reach the service (CI here): report, do not fail
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Installed name -> version of ``root`` with ``extras`` and everything they require."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (another platform's marker): nothing to audit
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found and not wanted:
            continue
        found[key] = dist.version
        for requirement in dist.requires or []:
            marker = requirement.partition(";")[2]
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra and extra.group(1) not in wanted:
                continue
            sub = re.search(r"\[([^\]]+)\]", requirement.partition(";")[0])
            todo.append((_name(requirement), tuple(e.strip() for e in sub.group(1).split(",")) if sub else ()))
    found.pop("taskloop", None)
    return found


def main(argv: list[str]) -> int:
    offline = "--offline" in argv
    unaudited = 0 if offline else 2  # the exit code of an audit that checked less than everything
    pins = closure("taskloop", ("dev",))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    service = os.environ.get("TASKLOOP_AUDIT_SERVICE", "pypi")
    command = ["pip-audit", "-r", handle.name, "--no-deps", "--disable-pip", "-f", "json",
               "--progress-spinner", "off", "-s", service]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    os.unlink(handle.name)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        print(f"pip-audit: NOT AUDITED — pip-audit failed (exit {done.returncode}) without a report:\n"
              f"{done.stderr.strip()[-2000:]}", file=sys.stderr)
        return unaudited
    deps = report.get("dependencies", [])
    skipped = [d for d in deps if d.get("skip_reason")]
    audited = [d for d in deps if not d.get("skip_reason")]
    vulnerable = [d for d in audited if d.get("vulns")]
    for dep in vulnerable:
        for vuln in dep["vulns"]:
            print(f"pip-audit: {dep['name']} {dep['version']}: {vuln['id']} (fixed in "
                  f"{', '.join(vuln.get('fix_versions') or ['-'])})", file=sys.stderr)
    print(f"pip-audit ({service}): {len(audited)} of {len(deps)} dependencies audited, "
          f"{len(vulnerable)} with known vulnerabilities")
    if skipped:
        reasons = sorted({re.sub(r":.*", "", d["skip_reason"]) for d in skipped})
        print(f"pip-audit: NOT AUDITED: {len(skipped)} of {len(deps)} dependencies could not be checked "
              f"({'; '.join(reasons)[:300]}) — this machine cannot reach the {service} vulnerability "
              "service; run `python .ci/audit.py` where it can", file=sys.stderr)
    if vulnerable:
        return 1
    return unaudited if skipped or not deps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
