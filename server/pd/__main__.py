"""``python -m server.pd --config-file conf/pd/coordinator.json``: the PD coordinator."""
import sys

from server.pd.coordinator.app import main

sys.exit(main())
