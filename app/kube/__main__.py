"""`python -m prefillshare.app.kube ...`: the same as `prefillshare k8s ...`."""
import sys

from prefillshare.app.kube.commands import main

sys.exit(main())
