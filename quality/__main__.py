from quality.gate import main

raise SystemExit(main())
