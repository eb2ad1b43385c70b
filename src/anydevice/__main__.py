"""``python -m anydevice`` is the ``anydevice`` command."""

from anydevice.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
