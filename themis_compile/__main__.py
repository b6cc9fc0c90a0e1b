from themis_compile.cli import main

main()
