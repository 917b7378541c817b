"""``python -m commlab.loop --config run.yaml [key=value ...]``: one training worker."""

from commlab.loop.worker import main

raise SystemExit(main())
