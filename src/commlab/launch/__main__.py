"""``python -m commlab.launch --config run.yaml``: the same as ``commlab launch``."""

from commlab.launch.command import end_process, main

end_process(main())
