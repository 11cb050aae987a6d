from rlctl.cli import main

main()
