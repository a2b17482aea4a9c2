from verispec.cli import main

main()
