from strata.daemon.cli import main

raise SystemExit(main())
