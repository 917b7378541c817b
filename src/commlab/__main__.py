from commlab.cli import main

raise SystemExit(main(as_program=True))
