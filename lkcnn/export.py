"""`python -m lkcnn.export CHECKPOINT OUT_DIR`: the exporter's command line (the exporter is lkcnn.deploy.export)."""
from lkcnn.deploy.export import main

if __name__ == "__main__":
    main()
