"""``python -m turbo_dispatch.cli``: the same as the ``turbo-dispatch`` script."""
from . import main

raise SystemExit(main())
