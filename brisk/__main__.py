from brisk.cli import main

raise SystemExit(main())
