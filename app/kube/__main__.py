"""`python -m app.kube ...`: the same as `prefillshare k8s ...`."""
import sys

from app.kube.commands import main

sys.exit(main())
