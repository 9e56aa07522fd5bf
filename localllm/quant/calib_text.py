"""Built-in English text: calibration for GPTQ/AWQ (no downloads) and a separate, fixed sample for
perplexity checks. Written for this project; the two sets share no sentences."""

CALIBRATION = [
    "The river begins as a thin stream high in the mountains, fed by snow that melts a little every "
    "afternoon. By the time it reaches the valley it is wide and slow, and the farmers who live along "
    "its banks have learned to read its moods. In spring they watch the water rise and move their "
    "animals to higher ground; in late summer they open small channels to carry it into the fields.",

    "To make a simple bread, mix five hundred grams of flour with ten grams of salt, seven grams of dry "
    "yeast and about three hundred and fifty milliliters of warm water. Knead the dough for ten minutes "
    "until it is smooth, cover it, and let it rise for an hour. Shape it into a loaf, let it rise again, "
    "and bake it at two hundred and twenty degrees until the crust is deep brown and sounds hollow.",

    "A function in a program is a named piece of code that takes some inputs and returns a result. "
    "Good functions do one thing, have clear names, and avoid changing state that the caller does not "
    "expect. When a function grows too long, it is usually a sign that it is doing several jobs at once "
    "and should be split into smaller pieces that can be tested on their own.",

    "In the eighteenth century, most goods crossed the ocean on wooden sailing ships that depended on "
    "the wind. A voyage from Europe to the Americas could take six weeks or more, and captains planned "
    "their routes around the trade winds and the seasons. The arrival of steam engines in the next "
    "century made travel faster and more predictable, and it changed the economy of every port city.",

    "Photosynthesis is the process by which plants use light to turn carbon dioxide and water into "
    "sugar and oxygen. It takes place mainly in the leaves, inside small structures called "
    "chloroplasts, which contain the green pigment chlorophyll. The sugar feeds the plant and, through "
    "the food chain, almost every other living thing on land.",

    "\"Are you coming to the meeting tomorrow?\" asked Maria. \"I think so,\" said Tom, \"but I might be "
    "a few minutes late. My train usually arrives at half past eight, and the office is a short walk "
    "from the station.\" \"That's fine,\" she replied. \"We will start with the budget and leave the "
    "schedule for the end, so you won't miss anything important.\"",

    "The human heart beats around one hundred thousand times a day. It has four chambers: two atria "
    "that receive blood and two ventricles that pump it out. The right side sends blood to the lungs, "
    "where it picks up oxygen, and the left side pushes that oxygen-rich blood through the arteries to "
    "the rest of the body. Regular exercise makes the heart muscle stronger and more efficient.",

    "When you travel to a new city, it helps to walk. Buses and taxis are quick, but on foot you notice "
    "the small shops, the smell of a bakery in the morning, the way people greet each other in the "
    "street. Many travelers say that their best memories come from getting a little lost and finding "
    "a quiet square or a market that was not in any guidebook.",

    "Interest is the price of borrowing money. If you put one thousand dollars in a savings account "
    "that pays five percent a year, you will have one thousand and fifty dollars after twelve months. "
    "If the interest is compounded, the next year you earn interest on the interest as well, which is "
    "why small differences in the rate matter a great deal over long periods of time.",

    "The old library had tall windows and long wooden tables, and in the afternoon the light fell "
    "across the rows of books in wide golden bands. Students came to study in silence, and the only "
    "sounds were the turning of pages and the soft steps of the librarian, who seemed to know where "
    "every volume was kept without ever looking at the catalog.",

    "To reset the device, hold the power button for ten seconds until the light blinks twice. Release "
    "the button and wait for the light to turn solid green. If the light turns red instead, unplug the "
    "device, wait one minute, and try again. Your settings will be erased, so write down your network "
    "name and password before you begin.",

    "Volcanoes form where molten rock from deep inside the earth finds a way to the surface. Some, like "
    "those in Hawaii, release lava slowly and build wide, gentle mountains over thousands of years. "
    "Others explode violently, throwing ash high into the atmosphere, where it can travel around the "
    "world and even cool the climate for a year or two.",

    "The committee reviewed the proposal carefully and agreed that the project was worth pursuing, but "
    "it asked the team to reduce the cost by ten percent and to provide a clearer plan for the second "
    "phase. A revised version will be presented next month, after the engineers have finished testing "
    "the new materials and the finance office has checked the estimates.",

    "Learning a musical instrument takes patience. At first the fingers feel clumsy and the sounds are "
    "harsh, but with daily practice the movements become automatic and the mind is free to listen. "
    "Teachers often say that twenty minutes every day is better than two hours once a week, because the "
    "brain needs time and repetition to build new habits.",

    "A database stores information in tables made of rows and columns. Each row describes one item, "
    "such as a customer or an order, and each column holds one property of that item. Queries let you "
    "select the rows you need, join tables that share a key, and sort or group the results, which makes "
    "it possible to answer questions about millions of records in a fraction of a second.",

    "The first snow of the year arrived quietly during the night. In the morning the roofs were white, "
    "the cars were buried up to their windows, and the children ran outside before breakfast to build "
    "a snowman. Their parents stood at the door with cups of coffee, watching, and trying to remember "
    "where they had put the shovel last winter.",
    "Most modern cities grew around a harbor, a river crossing or a market. Over the centuries the "
    "walls came down, the streets were widened for carriages and later for cars, and the old center "
    "became a place for shops, offices and tourists. Planners today try to bring people back to these "
    "districts by adding housing, parks and cycle lanes, and by limiting traffic in the narrowest streets.",

    "Here is how to change a flat tire. First, park on level ground, turn on the hazard lights and put "
    "on the parking brake. Loosen the wheel nuts slightly while the car is still on the ground. Then "
    "raise the car with the jack, remove the nuts and the wheel, fit the spare, and tighten the nuts by "
    "hand. Lower the car and finish tightening the nuts in a star pattern so the wheel sits evenly.",

    "Electric current is the flow of charge through a conductor, such as a copper wire. The voltage "
    "between two points pushes the charge, and the resistance of the material slows it down. Ohm's law "
    "states that the current equals the voltage divided by the resistance, so doubling the voltage "
    "across a simple resistor doubles the current that flows through it.",

    "She opened the letter slowly, as if the paper might break. It was from her grandmother, written in "
    "the careful, slanted hand she remembered from birthday cards. The letter spoke of the garden, of "
    "the apple tree that had finally given fruit, and of a small box hidden in the attic that was meant "
    "for her, and only for her, when the time was right.",

    "Good customer service begins with listening. When a customer calls with a problem, let them "
    "explain it fully before you offer a solution, repeat the key points back to make sure you have "
    "understood, and tell them clearly what will happen next. Even when you cannot give them what they "
    "want, a calm and honest answer usually leaves a better impression than a vague promise.",

    "The moon has no light of its own; it shines because it reflects sunlight. As it travels around "
    "the earth once every twenty-nine and a half days, we see different portions of its sunlit half, "
    "which is why it seems to grow from a thin crescent to a full disk and then shrink again. The same "
    "side always faces us, because the moon turns on its axis exactly once for each orbit.",

    "In many languages, the most common verbs are also the most irregular. Words like be, have, go and "
    "do are used so often that their old forms survived while rarer verbs were made regular over time. "
    "This is why learners must memorize went and was, while a verb borrowed recently, such as to email, "
    "simply follows the usual pattern and becomes emailed in the past tense.",

    "Version control systems keep a history of every change made to a set of files. Each change is "
    "recorded with a message, an author and a date, so that a team can see who changed what and why. "
    "Branches let developers work on new features without disturbing the main line of development, and "
    "merging brings their work back together once it has been reviewed and tested.",

    "The forest was quiet except for the wind in the tall pines. A deer stepped out from behind a fallen "
    "log, lifted its head and listened. Somewhere far away a woodpecker was knocking on a dead trunk, and "
    "a small stream ran under the roots of an old oak, carrying leaves and needles down toward the lake "
    "at the bottom of the valley.",

    "A healthy diet does not have to be complicated. Eat plenty of vegetables, fruit and whole grains, "
    "choose water instead of sugary drinks, and keep processed snacks for special occasions. Cooking at "
    "home gives you control over the amount of salt and fat in your meals, and it is often cheaper than "
    "eating out, especially if you plan your shopping for the week.",

    "The printing press, developed in Europe in the fifteenth century, made books far cheaper and more "
    "common than before. Ideas that had once spread slowly through handwritten copies could now reach "
    "thousands of readers within a few years. Historians link the press to the growth of literacy, to "
    "the spread of new scientific ideas and to deep changes in religion and politics.",

    "Q: How long should I boil an egg? A: For a soft egg with a runny yolk, about six minutes after the "
    "water returns to a boil. For a firm white and a creamy center, eight minutes. For a fully hard egg, "
    "ten to twelve minutes. Put the eggs in cold water right afterwards; it stops the cooking and makes "
    "them much easier to peel.",

    "Glaciers are rivers of ice that move under their own weight. They form where more snow falls in "
    "winter than melts in summer, so that the snow builds up year after year and is pressed into ice. "
    "As they slide downhill they carve deep valleys and carry rocks for great distances. Many glaciers "
    "around the world are now shrinking because of rising temperatures.",

    "The team had three days to finish the report. On the first day they gathered the data and checked "
    "it for errors. On the second they wrote the main sections and argued about the conclusions. On the "
    "third they cut the text by half, fixed the charts, and sent it off ten minutes before the deadline, "
    "tired but proud of what they had done together.",

    "Vaccines train the immune system to recognize a germ without causing the disease. They contain a "
    "weakened or inactive form of the germ, or just one of its proteins, or instructions for making that "
    "protein. When the real germ appears later, the body already has the right antibodies and memory "
    "cells ready, and it can fight the infection quickly.",

    "Chess is played on a board of sixty-four squares by two players, one with the white pieces and one "
    "with the black. Each side has a king, a queen, two rooks, two bishops, two knights and eight pawns. "
    "The goal is to checkmate the opponent's king, which means attacking it in such a way that it has "
    "no safe square to move to and the attack cannot be blocked.",

    "Our company was founded in a small garage by two friends who wanted to build better tools for "
    "farmers. Today we employ more than four hundred people in six countries, but we still test every "
    "new product in the field, with the people who will use it, before it goes on sale. We believe that "
    "simple, reliable machines are worth more than clever ones that break.",

    "To write a clear email, put the main point in the first sentence, keep paragraphs short, and end "
    "with the action you need and the date you need it by. Read the message once more before sending "
    "it, and ask yourself whether the reader could misunderstand anything. A subject line that says what "
    "the email is about helps people find it again later.",

    "Rain forests cover only a small part of the earth's surface, yet they are home to more than half "
    "of all known species of plants and animals. The trees grow so close together that little light "
    "reaches the ground, and many creatures live their whole lives high in the canopy. Cutting these "
    "forests releases carbon and destroys habitats that cannot easily be replaced.",

    "The train left the station just after dawn. Through the window the passengers watched the suburbs "
    "give way to fields, then to low hills covered with vineyards. A child counted cows, an old man read "
    "his newspaper from the first page to the last, and a young woman in a green coat wrote in a small "
    "notebook, stopping now and then to look out at the passing villages.",

    "Numbers written in binary use only two digits, zero and one. Each position stands for a power of "
    "two, so the binary number one zero one means four plus zero plus one, which is five. Computers use "
    "binary because it is easy to build circuits that are either on or off, and every number, letter, "
    "picture and sound inside a computer is stored as long strings of these two digits.",

    "Before you plant a garden, look at how the sun moves across the yard during the day. Most "
    "vegetables need at least six hours of direct sunlight, while many flowers and herbs are happy with "
    "less. Test the soil, add compost to improve it, and start with a small bed that you can look after "
    "easily; it is better to grow a few plants well than many plants badly.",
]

# held out from calibration: what perplexity is measured on
EVAL = [
    "Bees communicate the location of flowers to the rest of the hive with a kind of dance. A worker "
    "that has found a good source of nectar returns and moves in a figure-eight pattern, and the angle "
    "of the straight part of the dance tells the others the direction of the flowers relative to the "
    "sun, while the length of the dance tells them how far away the flowers are.",

    "The town council voted on Tuesday to build a new public swimming pool next to the school. The "
    "project will be paid for partly by a national grant and partly by the town's own budget, and "
    "construction is expected to start in the autumn. Several residents spoke at the meeting, most of "
    "them in favor, although some worried about traffic and parking near the site.",

    "If you want to keep a plant healthy indoors, place it near a window where it gets bright but "
    "indirect light, and water it only when the top few centimeters of soil feel dry. Too much water "
    "is a more common problem than too little, because the roots need air as well as moisture. Turn "
    "the pot every week or two so that the plant grows evenly instead of leaning toward the glass.",

    "The museum's new exhibition tells the story of writing, from the first marks pressed into clay "
    "tablets to the printing press and the computer screen. Visitors can try to write their names in "
    "ancient scripts, watch a craftsman set metal type by hand, and see how the shape of letters "
    "changed as people moved from brushes and reeds to pens and keyboards.",

    "Sleep is not simply a pause in the day. While we sleep, the brain sorts through what happened, "
    "strengthens some memories and lets others fade, and the body repairs tissue and balances its "
    "hormones. Adults who regularly sleep less than six hours a night are more likely to have trouble "
    "concentrating, and over time they face a higher risk of several long-term illnesses.",
    "The bridge was closed for repairs for most of the summer, so drivers had to take a long detour "
    "through the hills. Local shop owners said that business fell sharply during those months, because "
    "fewer visitors passed through the center of the village. When the bridge finally reopened in "
    "September, the mayor cut a ribbon and the school band played on the riverbank.",

    "A recipe for a quick tomato sauce: warm two spoons of olive oil in a pan, add a chopped onion and "
    "cook it gently until it is soft. Add two cloves of garlic, a can of crushed tomatoes, a pinch of "
    "salt and a little sugar, and let the sauce simmer for twenty minutes, stirring from time to time. "
    "Finish it with fresh basil and serve it over pasta with grated cheese.",

    "Many people believe that goldfish have a memory of only a few seconds, but experiments have shown "
    "that they can remember things for months. Fish have been trained to push levers for food, to "
    "respond to sounds, and even to recognize the person who usually feeds them. The old belief says "
    "more about how little attention we pay to animals than about the animals themselves.",

    "The software update includes several improvements. Files now open faster, the search bar shows "
    "results as you type, and a new dark theme is easier on the eyes at night. We have also fixed a "
    "problem that caused the application to close unexpectedly when printing large documents. Please "
    "restart your computer after installing the update so that all changes take effect.",

    # added later (written before any quantizer was measured on it): 676 -> ~1600 tokens, so one
    # paragraph moves the perplexity ratio less
    "The library on the corner of the square has been open for more than a hundred years. It began as a "
    "single room above a bakery, with a few shelves of donated books and a volunteer who came in on "
    "Saturday mornings. Today it has three floors, a children's corner with cushions and puppets, and a "
    "quiet room at the top where students prepare for their exams. The librarians say that people still "
    "come for the books, but many also come for the free internet, the warm chairs in winter, and the "
    "simple pleasure of being somewhere calm.",

    "When you learn to ride a bicycle, the hardest part is not pedaling but trusting that the bicycle "
    "will stay up once it is moving. Most children wobble for a few days, fall a few times, and then "
    "suddenly find their balance, as if a switch had been turned on. Adults who learn later often find it "
    "harder, not because their bodies are less able, but because they are more afraid of falling and hold "
    "the handlebars too tightly.",

    "The weather service has issued a warning for strong winds along the coast tonight and tomorrow "
    "morning. Gusts may reach ninety kilometers per hour on exposed headlands, and waves of four to five "
    "meters are expected. Ferries between the islands have been cancelled until noon, and people are "
    "advised to secure loose objects in gardens and on balconies and to stay away from the sea front "
    "while the storm passes.",

    "Volcanoes form where molten rock from deep inside the earth finds a way to the surface. Some, like "
    "those in Hawaii, release lava slowly and steadily, building wide, gentle slopes over thousands of "
    "years. Others trap gas under pressure until it escapes in a violent explosion that throws ash high "
    "into the sky. Scientists watch for small earthquakes, changes in the shape of the ground and gases "
    "leaking from the rock to guess when an eruption may be coming.",

    "Dear Maria, thank you so much for the lovely birthday card and the book you sent. I started reading "
    "it on the train yesterday and almost missed my stop because I could not put it down. The weather "
    "here has finally turned warm, and the cherry tree in front of the house is covered in flowers. We "
    "hope you can visit us in the summer; the guest room is ready whenever you want it. With love, Anna.",

    "A good password is long, hard to guess, and different for every account. Instead of a short word "
    "with a few numbers added at the end, it is better to use a phrase of four or five unrelated words, "
    "or to let a password manager create and remember random passwords for you. Turning on two-step "
    "verification adds another layer of protection, because a stolen password alone is then not enough to "
    "get into your account.",

    "The chess club meets every Thursday evening in the back room of the community center. Beginners are "
    "welcome, and the older members are happy to explain the rules and play slow, friendly games with "
    "newcomers. Once a month the club holds a small tournament with a time limit of fifteen minutes per "
    "player, and the winner's name is written on a board by the door, next to the names of champions "
    "going back forty years.",

    "Coffee plants grow best on hillsides in warm countries close to the equator, where there is plenty "
    "of rain and the temperature stays mild all year. The fruit, called a cherry, turns red when it is "
    "ripe and is usually picked by hand. Inside each cherry are two seeds, which are dried, removed from "
    "the fruit, and later roasted. The roasting brings out hundreds of different flavors, which is why "
    "two cups of coffee from the same farm can taste so different.",

    "To change a flat tire, first stop the car in a safe place away from traffic and turn on the hazard "
    "lights. Loosen the nuts on the wheel slightly before lifting the car with the jack, then raise the "
    "car, remove the nuts and the wheel, and put the spare wheel in its place. Tighten the nuts by hand, "
    "lower the car to the ground, and finish tightening them firmly in a crossing pattern. Remember to "
    "have the damaged tire repaired or replaced as soon as possible.",

    "The old lighthouse no longer guides ships, because modern boats find their way with satellites and "
    "electronic charts. A group of local volunteers bought it from the government for a symbolic price "
    "and turned it into a small museum. Visitors climb the narrow spiral staircase to the lamp room, "
    "where they can see the huge glass lens that once sent a beam of light thirty kilometers out to sea, "
    "and read the logbooks of the keepers who lived there with their families.",
]
