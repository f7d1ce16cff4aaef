"""``python -m taskloop.celery_fixes``: is each fix still needed with the installed libraries, and
does what the extensions rely on still hold?"""

from __future__ import annotations

from taskloop.celery_fixes import CHECKED, probe_all, relied_on, unchecked_versions


def main() -> None:
    for cause, present in probe_all().items():
        print(f"{'still needed' if present else 'fixed upstream (the fix can go)'}: {cause}")
    for what, holds in relied_on().items():
        print(f"{'holds' if holds else 'NO LONGER HOLDS (the extension is off)'}: {what}")
    for line in unchecked_versions():
        print(f"not checked: {line}")
    print("checked against: " + ", ".join(f"{name} {'/'.join(v)}" for name, v in CHECKED.items()))


if __name__ == "__main__":
    main()
